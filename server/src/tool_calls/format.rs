//! The tool-call dialects we parse: their names on the command line, how a chat template shows
//! which one a model speaks, and where each dialect's markup begins and ends in a completion.

/// A tool-call markup dialect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`: Hermes 2 Pro, Qwen 2.5 and
    /// 3, and our fallback prompt for templates that do not render tools.
    Hermes,
    /// Llama 3.x: `{"name": ..., "parameters": {...}}` as the whole reply, or after
    /// `<|python_tag|>`; several calls are separated by `;`.
    Llama3Json,
    /// DeepSeek V3: `<｜tool▁calls▁begin｜>` blocks of ``function<｜tool▁sep｜>name\n```json ...``.
    DeepSeekV3,
    /// DeepSeek V3.1: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
    DeepSeekV31,
    /// DeepSeek V3.2 DSML: `<｜DSML｜function_calls>` with `invoke` and `parameter` tags.
    DsmlV32,
    /// DeepSeek V4 DSML: as V3.2 with the block named `tool_calls`.
    DsmlV4,
}

/// Where one dialect's markup begins and ends in a completion's text.
#[derive(Clone, Copy, Debug)]
pub(super) struct Markup {
    /// The marker that opens a tool section.
    pub open: &'static str,
    /// The marker that closes it; `None` when a section runs to the end of the text (Llama 3,
    /// whose calls are the rest of the reply).
    pub close: Option<&'static str>,
    /// Whether a text whose first non-blank character is `{` is one section as a whole (Llama 3's
    /// bare JSON calls, as `LlamaParser::parse_complete` reads them).
    pub bare_json: bool,
}

impl ToolFormat {
    pub const ALL: [ToolFormat; 6] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::DeepSeekV3,
        ToolFormat::DeepSeekV31,
        ToolFormat::DsmlV32,
        ToolFormat::DsmlV4,
    ];

    /// The name the `--tool-call-parser` flag takes.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::DeepSeekV3 => "deepseek_v3",
            ToolFormat::DeepSeekV31 => "deepseek_v31",
            ToolFormat::DsmlV32 => "dsml_v32",
            ToolFormat::DsmlV4 => "dsml_v4",
        }
    }

    /// The format a `--tool-call-parser` name stands for; the error lists the valid names.
    pub fn from_name(name: &str) -> Result<ToolFormat, String> {
        ToolFormat::ALL.into_iter().find(|format| format.name() == name).ok_or_else(|| {
            let names: Vec<&str> = ToolFormat::ALL.iter().map(|f| f.name()).collect();
            format!("unknown tool-call parser {name:?}: expected one of {}", names.join(", "))
        })
    }

    /// Chosen from a model's chat template text by the markers it contains; None when it shows
    /// no tool format. DSML is tried before the older DeepSeek markers and those before the
    /// generic ones, so a template that shows several (a DeepSeek template quoting Hermes in a
    /// comment, say) is read as its most specific dialect.
    pub fn detect(chat_template: &str) -> Option<ToolFormat> {
        let has = |marker: &str| chat_template.contains(marker);
        if has("｜DSML｜tool_calls") {
            Some(ToolFormat::DsmlV4)
        } else if has("｜DSML｜function_calls") {
            Some(ToolFormat::DsmlV32)
        } else if has("<｜tool▁calls▁begin｜>") || has("<｜tool▁call▁begin｜>") {
            // V3 fences the arguments in a ```json block after a `function` type; V3.1 does not.
            if has("```json") {
                Some(ToolFormat::DeepSeekV3)
            } else {
                Some(ToolFormat::DeepSeekV31)
            }
        } else if has("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if has("<|python_tag|>") || (has("<|start_header_id|>") && has("ipython")) {
            // Llama 3.1 writes `<|python_tag|>`; 3.2 and 3.3 only the `ipython` role of tool results.
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The format to parse a completion with when the request offers tools: the template's own
    /// ([`ToolFormat::detect`]), or Hermes when the template never reads `tools`, because then
    /// `lockstep_gpu::chat` tells the model about them in a system message asking for Hermes
    /// markup. None when the template renders tools in a dialect we do not know.
    pub fn for_template(chat_template: &str) -> Option<ToolFormat> {
        ToolFormat::detect(chat_template).or_else(|| {
            (!lockstep_gpu::chat::template_mentions_tools(chat_template))
                .then_some(ToolFormat::Hermes)
        })
    }

    pub(super) fn markup(self) -> Markup {
        let section = |open, close| Markup { open, close: Some(close), bare_json: false };
        match self {
            ToolFormat::Hermes => section("<tool_call>", "</tool_call>"),
            ToolFormat::Llama3Json => {
                Markup { open: "<|python_tag|>", close: None, bare_json: true }
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                section("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
            }
            ToolFormat::DsmlV32 => section("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
            ToolFormat::DsmlV4 => section("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
        }
    }
}
