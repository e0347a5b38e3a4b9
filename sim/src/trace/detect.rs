//! Which importer reads a trace: a directory is WEKA sessions; a `.csv` file is Azure's, a
//! `.json` file a WEKA session; anything else is told by its first line (a `lockstep-trace`
//! header, a Mooncake request, a WEKA session document, or Azure's CSV header).

use std::path::Path;

use lockstep_server::record::TRACE_BYTES_MAX;
use serde_json::Value;

use super::draft::check_options;
use super::{ImportOptions, SimTrace, azure, mooncake, native, weka};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Native,
    Mooncake,
    Azure,
    Weka,
}

/// The trace at `path` (a file of at most 1 GiB, or a directory of WEKA session files). An
/// error names the file and, where there is one, the line.
pub fn load(path: &Path, options: &ImportOptions) -> Result<SimTrace, String> {
    check_options(options)?;
    let shown = path.display();
    let name = path.file_stem().map_or_else(|| shown.to_string(), |s| s.to_string_lossy().into());
    if path.is_dir() {
        return weka::load(&name, path, options);
    }
    let size = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?.len();
    if size > TRACE_BYTES_MAX {
        return Err(format!("{shown}: {size} bytes, more than {TRACE_BYTES_MAX}"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: {e}"))?;
    let format = match path.extension().and_then(|x| x.to_str()) {
        Some("csv") => Ok(Format::Azure),
        Some("json") => Ok(Format::Weka),
        _ => detect(&text),
    };
    format
        .and_then(|format| import(format, &name, &text, options))
        .map_err(|e| format!("{shown}: {e}"))
}

/// The trace in `text`, its format told by its content; an error names `name` and the line.
pub fn parse(name: &str, text: &str, options: &ImportOptions) -> Result<SimTrace, String> {
    check_options(options)?;
    detect(text)
        .and_then(|format| import(format, name, text, options))
        .map_err(|e| format!("{name}: {e}"))
}

fn import(
    format: Format,
    name: &str,
    text: &str,
    options: &ImportOptions,
) -> Result<SimTrace, String> {
    match format {
        Format::Native => native::parse(name, text, options),
        Format::Mooncake => mooncake::parse(name, text, options),
        Format::Azure => azure::parse(name, text, options),
        Format::Weka => weka::parse(name, text, options),
    }
}

fn detect(text: &str) -> Result<Format, String> {
    let Some((i, first)) = text.lines().enumerate().find(|(_, l)| !l.trim().is_empty()) else {
        return Err("empty: no requests".into());
    };
    let (line, first) = (i + 1, first.trim().trim_start_matches('\u{feff}'));
    if !first.starts_with('{') {
        return if first.starts_with("TIMESTAMP,") {
            Ok(Format::Azure)
        } else {
            Err(format!("line {line}: not a trace this reads (JSON Lines, a WEKA session or CSV)"))
        };
    }
    let object = match serde_json::from_str::<Value>(first) {
        Ok(Value::Object(object)) => object,
        Ok(_) => return Err(format!("line {line}: not a JSON object")),
        // A WEKA session written over several lines.
        Err(_)
            if serde_json::from_str::<Value>(text).is_ok_and(|v| v.get("requests").is_some()) =>
        {
            return Ok(Format::Weka);
        }
        Err(e) => return Err(format!("line {line}: not JSON: {e}")),
    };
    if object.contains_key("format") {
        Ok(Format::Native)
    } else if object.contains_key("requests") {
        Ok(Format::Weka)
    } else if ["timestamp", "input_length", "hash_ids"].iter().any(|k| object.contains_key(*k)) {
        Ok(Format::Mooncake)
    } else {
        Err(format!(
            "line {line}: neither a lockstep-trace header (format), a Mooncake request \
             (timestamp, input_length, output_length, hash_ids) nor a WEKA session (requests)"
        ))
    }
}
