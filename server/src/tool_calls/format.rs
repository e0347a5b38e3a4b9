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
    /// DeepSeek V4.1 DSML: a space before each tag's name (`<｜DSML｜ calls>`, `<｜DSML｜ invoke`,
    /// `<｜DSML｜ parameter`), an `invoke` outside a block a call too, and the reference's rule
    /// that everything from the first of them on belongs to the calls.
    DsmlV41,
}

/// Where one dialect's markup begins and ends in a completion's text.
#[derive(Clone, Copy, Debug)]
pub(super) struct Markup {
    /// The markers that open a tool section (the first of them in the text does).
    pub opens: &'static [&'static str],
    /// The marker that closes it; `None` when a section runs to the end of the text (Llama 3,
    /// whose calls are the rest of the reply; DeepSeek V4.1, whose reference parser reads
    /// nothing after its calls as content).
    pub close: Option<&'static str>,
    /// Whether a text whose first non-blank character is `{` is one section as a whole (Llama 3's
    /// bare JSON calls, as `LlamaParser::parse_complete` reads them).
    pub bare_json: bool,
}

impl ToolFormat {
    pub const ALL: [ToolFormat; 7] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::DeepSeekV3,
        ToolFormat::DeepSeekV31,
        ToolFormat::DsmlV32,
        ToolFormat::DsmlV4,
        ToolFormat::DsmlV41,
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
            ToolFormat::DsmlV41 => "dsml_v41",
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
        if has("｜DSML｜ calls") {
            Some(ToolFormat::DsmlV41)
        } else if has("｜DSML｜tool_calls") {
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
        let section = |open: &'static [&'static str], close| Markup {
            opens: open,
            close: Some(close),
            bare_json: false,
        };
        match self {
            ToolFormat::Hermes => section(&["<tool_call>"], "</tool_call>"),
            ToolFormat::Llama3Json => {
                Markup { opens: &["<|python_tag|>"], close: None, bare_json: true }
            }
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
                section(&["<｜tool▁calls▁begin｜>"], "<｜tool▁calls▁end｜>")
            }
            ToolFormat::DsmlV32 => section(&[DSML_V32.block_open], DSML_V32.block_close),
            ToolFormat::DsmlV4 => section(&[DSML_V4.block_open], DSML_V4.block_close),
            ToolFormat::DsmlV41 => Markup {
                opens: &[DSML_V41.block_open, DSML_V41.invoke_open],
                close: None,
                bare_json: false,
            },
        }
    }

    /// The DSML dialects' tag names; None for the others.
    pub(super) fn dsml(self) -> Option<Dsml> {
        match self {
            ToolFormat::DsmlV32 => Some(DSML_V32),
            ToolFormat::DsmlV4 => Some(DSML_V4),
            ToolFormat::DsmlV41 => Some(DSML_V41),
            _ => None,
        }
    }
}

/// A DSML dialect's tags, as tool-parser's `DsmlDialect` names them (a test checks them against
/// it): V3.2's and V4's differ in their block's name, V4.1's put a space before every name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Dsml {
    /// `<｜DSML｜{block}>`.
    pub block_open: &'static str,
    pub block_close: &'static str,
    /// The start of an invoke tag, up to its name: `<｜DSML｜{invoke} name="`.
    pub invoke_open: &'static str,
    pub invoke_close: &'static str,
    /// `<｜DSML｜{parameter}`, before ` name="..." string="...">`.
    pub parameter_open: &'static str,
    pub parameter_close: &'static str,
}

const DSML_V32: Dsml = Dsml {
    block_open: "<｜DSML｜function_calls>",
    block_close: "</｜DSML｜function_calls>",
    invoke_open: "<｜DSML｜invoke name=\"",
    invoke_close: "</｜DSML｜invoke>",
    parameter_open: "<｜DSML｜parameter",
    parameter_close: "</｜DSML｜parameter>",
};

const DSML_V4: Dsml =
    Dsml {
        block_open: "<｜DSML｜tool_calls>", block_close: "</｜DSML｜tool_calls>", ..DSML_V32
    };

const DSML_V41: Dsml = Dsml {
    block_open: "<｜DSML｜ calls>",
    block_close: "</｜DSML｜ calls>",
    invoke_open: "<｜DSML｜ invoke name=\"",
    invoke_close: "</｜DSML｜ invoke>",
    parameter_open: "<｜DSML｜ parameter",
    parameter_close: "</｜DSML｜ parameter>",
};
