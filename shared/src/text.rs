//! Text hygiene for PostgreSQL: `text` and `jsonb` cannot hold U+0000 (NUL), which models,
//! tools and clients can all produce. Every value written to history, the journal or a thread
//! passes through here; each NUL becomes U+FFFD (the replacement character), so a stray NUL
//! never fails a write — a failed write would otherwise be retried forever. Likewise a client
//! time PostgreSQL cannot store ([`storable_time`]).

use std::borrow::Cow;

use serde_json::Value;

/// `s` with every NUL replaced by U+FFFD (borrowed when there is none).
pub fn clean(s: &str) -> Cow<'_, str> {
    if s.contains('\0') { Cow::Owned(s.replace('\0', "\u{FFFD}")) } else { Cow::Borrowed(s) }
}

/// `value` with every NUL in its strings and object keys replaced (borrowed when there is none).
pub fn clean_json(value: &Value) -> Cow<'_, Value> {
    // Walked in place: serialising a MiB of metadata just to look for NUL doubled its memory.
    fn has_nul(v: &Value) -> bool {
        match v {
            Value::String(s) => s.contains('\0'),
            Value::Array(a) => a.iter().any(has_nul),
            Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
            _ => false,
        }
    }
    if !has_nul(value) {
        return Cow::Borrowed(value);
    }
    fn walk(v: &Value) -> Value {
        match v {
            Value::String(s) => Value::String(clean(s).into_owned()),
            Value::Array(a) => Value::Array(a.iter().map(walk).collect()),
            Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (clean(k).into_owned(), walk(v))).collect()),
            other => other.clone(),
        }
    }
    Cow::Owned(walk(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_is_replaced_everywhere_and_clean_values_are_borrowed() {
        assert_eq!(clean("a\0b"), "a\u{FFFD}b");
        assert!(matches!(clean("ab"), Cow::Borrowed(_)));
        let v = json!({"k\u{0}": ["x\u{0}", {"y": "z\u{0}"}], "n": 1});
        assert_eq!(clean_json(&v).into_owned(), json!({"k\u{FFFD}": ["x\u{FFFD}", {"y": "z\u{FFFD}"}], "n": 1}));
        assert!(matches!(clean_json(&json!({"a": "b"})), Cow::Borrowed(_)));
    }
}

/// Whether PostgreSQL's `timestamptz` holds `at` (years 1..=9999 here: a time outside it fails
/// the statement, a 500 instead of the client's 400). Used by every parser of client times.
pub fn storable_time(at: &chrono::DateTime<chrono::Utc>) -> bool {
    (1..=9999).contains(&chrono::Datelike::year(at))
}
