//! Text hygiene for PostgreSQL: `text` and `jsonb` cannot hold U+0000 (NUL), which models,
//! tools and clients can all produce. Every value written to history, the journal or a thread
//! passes through here; each NUL becomes U+FFFD (the replacement character), so a stray NUL
//! never fails a write — a failed write would otherwise be retried forever. Likewise a client
//! time PostgreSQL cannot store ([`storable_time`]), and a JSON number `serde_json` would round
//! ([`inexact_number`]).

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

/// The first number of the JSON text `raw` (valid JSON) that would not reach a tool as written:
/// an integer beyond 64 bits or a decimal with more digits than a 64-bit float holds
/// (`12345678901234567890123`, `0.12345678901234567891`). JSON is parsed into
/// `serde_json::Value`, which keeps only `i64`, `u64` and `f64`; such a number would be rounded
/// and a tool would act on a value nobody sent (acceptance probe: an `amount` changed in flight
/// is the same class as arguments joined from the wrong pieces). Numbers that differ only in
/// spelling (`1.10`, `1E2`, `-0`) are exact and pass. Used for a model's tool arguments
/// (`tools`) and for every JSON request body (the api's middleware: 400 `invalid_number`).
pub fn inexact_number(raw: &str) -> Option<&str> {
    let bytes = raw.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < bytes.len() && matches!(bytes[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
                    i += 1;
                }
                let token = &raw[start..i];
                if !number_is_exact(token) {
                    return Some(token);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// True if the JSON number `token` survives `serde_json::Value` unchanged in value.
pub fn number_is_exact(token: &str) -> bool {
    let integer = !token.contains(['.', 'e', 'E']);
    if integer {
        // An integer beyond 64 bits becomes a float (`10^30` would reach a tool as `1e+30`, while a
        // reader with big integers — Python, PostgreSQL — takes the digits as sent: the ledger
        // and the tool would disagree; verification probe G).
        return token.parse::<i64>().is_ok() || token.parse::<u64>().is_ok();
    }
    // Parsed as serde_json parses it, then written back in its shortest exact form.
    match serde_json::from_str::<f64>(token) {
        Ok(float) if float.is_finite() => decimal(token) == decimal(&format!("{float:e}")),
        _ => false,
    }
}

/// A decimal number's value as `(negative, digits, exponent)` with `value = 0.digits x
/// 10^exponent`, without leading or trailing zeros in `digits` (zero is `(_, "", 0)`); `None`
/// for an exponent too large to hold.
fn decimal(number: &str) -> Option<(bool, String, i64)> {
    let (negative, unsigned) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.trim_start_matches('+').parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let leading = digits.len() - digits.trim_start_matches('0').len();
    let digits = digits.trim_start_matches('0').trim_end_matches('0');
    if digits.is_empty() {
        return Some((false, String::new(), 0));
    }
    let exponent = (whole.len() as i64 - leading as i64).checked_add(exponent)?;
    Some((negative, digits.to_owned(), exponent))
}
