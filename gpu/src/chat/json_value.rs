//! JSON request values as template values that keep their key order. transformers hands a
//! template Python dicts, whose keys stay in the order the client wrote them, and `tool | tojson`
//! writes them in that order; minijinja's own maps sort their keys, which would reorder every
//! tool schema in the prompt. Key order is serde_json's: the client's with its `preserve_order`
//! feature, sorted without it.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::Value;
use minijinja::value::{Enumerator, Object, ObjectRepr};

/// A JSON value for a template.
pub(super) fn to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            (None, None) => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => {
            Value::from(items.iter().map(to_value).collect::<Vec<_>>())
        }
        serde_json::Value::Object(map) => Value::from_object(OrderedMap::new(map)),
    }
}

/// A JSON object: its entries in order, and where each key is.
#[derive(Debug)]
struct OrderedMap {
    entries: Vec<(Value, Value)>,
    at: BTreeMap<String, usize>,
}

impl OrderedMap {
    fn new(map: &serde_json::Map<String, serde_json::Value>) -> OrderedMap {
        let entries = map.iter().map(|(k, v)| (Value::from(k.as_str()), to_value(v))).collect();
        let at = map.keys().enumerate().map(|(i, k)| (k.clone(), i)).collect();
        OrderedMap { entries, at }
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let at = *self.at.get(key.as_str()?)?;
        self.entries.get(at).map(|(_, value)| value.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let this = Arc::clone(self);
        Enumerator::KeyValueIter(Box::new(
            (0..this.entries.len()).map(move |at| this.entries[at].clone()),
        ))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_read_like_minijinja_maps() {
        let json = serde_json::json!({"b": [1, 2.5, null], "a": {"x": "y"}, "c": true});
        let env = minijinja::Environment::new();
        let render = |source: &str| {
            env.render_str(source, minijinja::context! { v => to_value(&json) }).unwrap()
        };
        assert_eq!(render("{{ v.a.x }} {{ v['b'][1] }} {{ v|length }} {{ v.c }}"), "y 2.5 3 True");
        assert_eq!(render("{% for k, x in v|items %}{{ k }}{% endfor %}"), {
            let keys: String = json.as_object().unwrap().keys().map(String::as_str).collect();
            keys
        });
        assert_eq!(render("{{ v is mapping }} {{ 'a' in v }} {{ 'z' in v }}"), "True True False");
        assert_eq!(render("{{ v.missing is defined }}"), "False");
    }
}
