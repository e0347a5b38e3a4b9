//! The `tojson` filter as transformers defines it for chat templates: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`. minijinja's
//! own `tojson` escapes `<`, `>`, `&` and `'` for HTML, which changes the text of every tool
//! schema and call that holds them, so the prompt would differ from the one the model was
//! trained on.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// How to write: Python's `json.dumps` keyword arguments.
#[derive(Clone, Debug)]
struct Style {
    indent: Option<usize>,
    ensure_ascii: bool,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// The filter: `value | tojson`, `tojson(indent=4)`, and the other keywords of `json.dumps`.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    // Python's defaults: ", " between items, "," when indenting (the newline separates them).
    let item_default = if indent.is_some() { "," } else { ", " };
    let (item_separator, key_separator) = match separators {
        None => (item_default.to_owned(), ": ".to_owned()),
        Some(pair) => {
            let part = |at: usize| -> Result<String, Error> {
                let part = pair.get_item(&Value::from(at))?;
                part.as_str().map(str::to_owned).ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "tojson separators are two strings")
                })
            };
            (part(0)?, part(1)?)
        }
    };
    let style = Style {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        item_separator,
        key_separator,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(value, ensure_ascii=False)`: what our own prompts write tools and calls with.
pub(super) fn dumps(value: &Value) -> Result<String, Error> {
    let style = Style {
        indent: None,
        ensure_ascii: false,
        item_separator: ", ".to_owned(),
        key_separator: ": ".to_owned(),
        sort_keys: false,
    };
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    Ok(out)
}

fn write_value(out: &mut String, value: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match value.kind() {
        // jinja2 would raise on an undefined value; null is the kinder reading of a missing field.
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_str(out, value.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items.len(), style, depth, |out, at| {
                write_value(out, &items[at], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|key| key.to_string());
            }
            write_container(out, ('{', '}'), keys.len(), style, depth, |out, at| {
                write_str(out, &key_text(&keys[at]), style.ensure_ascii);
                out.push_str(&style.key_separator);
                write_value(out, &value.get_item(&keys[at])?, style, depth + 1)
            })?;
        }
        kind => {
            let what = format!("tojson: a {kind} is not JSON serializable");
            return Err(Error::new(ErrorKind::InvalidOperation, what));
        }
    }
    Ok(())
}

/// Brackets around `count` items, laid out as `json.dumps` lays them out with `style`.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    count: usize,
    style: &Style,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if count == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', indent * level));
        }
    };
    for at in 0..count {
        if at > 0 {
            out.push_str(&style.item_separator);
        }
        newline(out, depth + 1);
        item(out, at)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Python turns keys that are not strings into their JSON text (`True` → `"true"`).
fn key_text(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::None | ValueKind::Undefined => "null".to_owned(),
        _ => key.to_string(),
    }
}

fn write_str(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that read back to the same value (Rust finds the
/// same digits), written fixed from 1e-4 up to 1e16 and in exponent form outside, `1e-05`.
fn python_float(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_owned();
    }
    if value.is_infinite() {
        return (if value > 0.0 { "Infinity" } else { "-Infinity" }).to_owned();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    if !(-4..16).contains(&exponent) {
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exponent_sign}{:02}", exponent.unsigned_abs());
    }
    let digits = mantissa.replace('.', "");
    let text = if exponent < 0 {
        format!("0.{}{digits}", "0".repeat(exponent.unsigned_abs() as usize - 1))
    } else {
        let whole = exponent as usize + 1;
        if digits.len() <= whole {
            format!("{digits}{}.0", "0".repeat(whole - digits.len()))
        } else {
            format!("{}.{}", &digits[..whole], &digits[whole..])
        }
    };
    format!("{sign}{text}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_python_writes_them() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::INFINITY, "Infinity"),
        ];
        for (value, python) in cases {
            assert_eq!(python_float(value), python, "{value:?}");
        }
    }

    #[test]
    fn strings_escape_as_python_does() {
        let mut out = String::new();
        write_str(&mut out, "a\"\\\n\u{1}<é😀", false);
        assert_eq!(out, "\"a\\\"\\\\\\n\\u0001<é😀\"");
        out.clear();
        write_str(&mut out, "é😀", true);
        assert_eq!(out, "\"\\u00e9\\ud83d\\ude00\"");
    }

    /// Expected strings from Python 3.11's `json.dumps` with the same keywords.
    #[test]
    fn keywords_lay_out_as_python_does() {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        let v = super::super::json_value::to_value(&serde_json::json!(
            {"a": "é<", "c": [1, {"a": [], "b": null}]}
        ));
        let render =
            |source: &str| env.render_str(source, minijinja::context! { v => v.clone() }).unwrap();
        assert_eq!(
            render("{{ v|tojson }}"),
            "{\"a\": \"é<\", \"c\": [1, {\"a\": [], \"b\": null}]}"
        );
        assert_eq!(
            render("{{ v|tojson(indent=4) }}"),
            "{\n    \"a\": \"é<\",\n    \"c\": [\n        1,\n        {\n            \"a\": [],\n            \"b\": null\n        }\n    ]\n}"
        );
        assert_eq!(
            render("{{ v|tojson(separators=(',', ':'), sort_keys=true, ensure_ascii=true) }}"),
            "{\"a\":\"\\u00e9<\",\"c\":[1,{\"a\":[],\"b\":null}]}"
        );
        assert_eq!(
            render("{{ v|tojson(indent=2, separators=(', ', ': '), ensure_ascii=true) }}"),
            "{\n  \"a\": \"\\u00e9<\", \n  \"c\": [\n    1, \n    {\n      \"a\": [], \n      \"b\": null\n    }\n  ]\n}"
        );
        assert!(env.render_str("{{ v|tojson(bogus=1) }}", minijinja::context! { v => 1 }).is_err());
    }
}
