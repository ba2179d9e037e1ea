//! The streaming partial answer (SPEC §6 step 4, §10): offsets and deltas.
//!
//! Workers journal `streaming` events `{runId, offset, delta}` where `offset` counts UTF-16 code
//! units (what browsers count) of the partial text before `delta`, and `offset: 0` restarts
//! the partial. Now and then they also store the whole partial in `threads.streaming_message`
//! with the journal sequence it covers, so a reader rebuilds the partial as of any journal
//! position from that snapshot plus the deltas after it ([`apply_delta`]), never from a
//! whole-text rewrite per tick.

/// Number of UTF-16 code units of `s`.
pub fn utf16_len(s: &str) -> usize {
    s.encode_utf16().count()
}

/// Applies a delta at `offset` (UTF-16 units) to `text`: `offset == 0` restarts it; a delta
/// that overlaps text already present adds only its new tail (a resent flush is harmless); a
/// delta beyond the end (a gap) is appended as is. Offsets inside a surrogate pair are rounded
/// down to a character boundary.
pub fn apply_delta(text: &mut String, offset: usize, delta: &str) {
    if offset == 0 {
        text.clear();
        text.push_str(delta);
        return;
    }
    let have = utf16_len(text);
    if offset >= have {
        text.push_str(delta);
        return;
    }
    // Skip the part of `delta` that is already present.
    let mut skip_units = have - offset;
    let mut cut = 0;
    for (i, ch) in delta.char_indices() {
        if skip_units == 0 {
            cut = i;
            break;
        }
        skip_units = skip_units.saturating_sub(ch.len_utf16());
        cut = i + ch.len_utf8();
    }
    if skip_units == 0 {
        text.push_str(&delta[cut..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_restart_append_and_deduplicate_overlaps() {
        let mut t = String::new();
        apply_delta(&mut t, 0, "Hel");
        apply_delta(&mut t, 3, "lo ");
        assert_eq!(t, "Hello ");
        // A resent flush overlapping what is there adds only the new tail.
        apply_delta(&mut t, 3, "lo wor");
        assert_eq!(t, "Hello wor");
        // Entirely old: nothing added.
        apply_delta(&mut t, 1, "el");
        assert_eq!(t, "Hello wor");
        // UTF-16: an emoji counts two units.
        let mut u = String::new();
        apply_delta(&mut u, 0, "a😀");
        assert_eq!(utf16_len(&u), 3);
        apply_delta(&mut u, 3, "b");
        apply_delta(&mut u, 1, "😀bc");
        assert_eq!(u, "a😀bc");
        apply_delta(&mut u, 0, "new");
        assert_eq!(u, "new");
    }
}
