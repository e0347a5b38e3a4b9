//! Tool calls written as each dialect's models write them: the texts the parsing tests read back
//! and the grammar tests hold to each dialect's grammar.

use lockstep_server::tool_calls::ToolFormat;
use serde_json::Value;

/// One call; `tight` writes Hermes without its newlines. DSML parameters in the arguments'
/// order, strings as raw text, the rest as JSON.
pub fn render_call(format: ToolFormat, name: &str, args: &Value, tight: bool) -> String {
    let json = serde_json::to_string(args).unwrap();
    match format {
        ToolFormat::Hermes if tight => {
            format!("<tool_call>{{\"name\": \"{name}\", \"arguments\": {json}}}</tool_call>")
        }
        ToolFormat::Hermes => {
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {json}}}\n</tool_call>")
        }
        ToolFormat::Llama3Json => format!("{{\"name\": \"{name}\", \"parameters\": {json}}}"),
        ToolFormat::DeepSeekV3 => format!(
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json}\n```<｜tool▁call▁end｜>"
        ),
        ToolFormat::DeepSeekV31 => {
            format!("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json}<｜tool▁call▁end｜>")
        }
        ToolFormat::DsmlV32 | ToolFormat::DsmlV4 | ToolFormat::DsmlV41 => {
            let s = dsml_space(format);
            let mut out = format!("<｜DSML｜{s}invoke name=\"{name}\">\n");
            for (key, value) in args.as_object().unwrap() {
                let (string, text) = match value {
                    Value::String(s) => (true, s.clone()),
                    other => (false, other.to_string()),
                };
                out.push_str(&format!(
                    "<｜DSML｜{s}parameter name=\"{key}\" string=\"{string}\">{text}</｜DSML｜{s}parameter>\n"
                ));
            }
            out + &format!("</｜DSML｜{s}invoke>\n")
        }
    }
}

/// Calls written together: one section, or consecutive Hermes sections.
pub fn render_group(format: ToolFormat, each: &[String]) -> String {
    match format {
        ToolFormat::Hermes => each.join("\n"),
        ToolFormat::Llama3Json => each.join("; "),
        ToolFormat::DeepSeekV3 => {
            format!("<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>", each.join("\n"))
        }
        ToolFormat::DeepSeekV31 => {
            format!("<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>", each.concat())
        }
        ToolFormat::DsmlV32 => {
            format!("<｜DSML｜function_calls>\n{}</｜DSML｜function_calls>", each.concat())
        }
        ToolFormat::DsmlV4 => {
            format!("<｜DSML｜tool_calls>\n{}</｜DSML｜tool_calls>", each.concat())
        }
        ToolFormat::DsmlV41 => format!("<｜DSML｜ calls>\n{}</｜DSML｜ calls>", each.concat()),
    }
}

/// DeepSeek V4.1 writes a space before each DSML tag's name.
pub fn dsml_space(format: ToolFormat) -> &'static str {
    if format == ToolFormat::DsmlV41 { " " } else { "" }
}
