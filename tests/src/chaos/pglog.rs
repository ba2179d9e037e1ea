//! Reading the PostgreSQL server log of the chaos cluster (`log_line_prefix = '%m [%p] %a: '`,
//! `log_lock_waits = on`): deadlocks with their victim and participants, and lock waits.
//!
//! A deadlock none of whose participants ran one of the chaos lock session's statements is a
//! deadlock between the product's own transactions: a lock-order bug (the product documents
//! one lock order, "active run, then thread, then pending runs", precisely so that this never
//! happens).

use std::collections::{BTreeMap, HashMap};

/// The statements of the chaos lock session (see `faults::locks`).
pub const LOCKER_STATEMENTS: [&str; 2] = ["SELECT 1 FROM runs WHERE id = $1 FOR UPDATE", "SELECT 1 FROM threads WHERE id = $1 FOR UPDATE"];

/// What the log says.
#[derive(Debug, Default)]
pub struct PgLog {
    /// Deadlock victims by application (worker ids folded into `agentloop-worker`).
    pub victims: BTreeMap<String, u64>,
    /// Deadlocks between product sessions only, as evidence lines.
    pub product_deadlocks: Vec<String>,
    pub lock_waits: u64,
}

fn prefix(line: &str) -> Option<(&str, &str, &str)> {
    // "2026-12-01 22:06:08.552 UTC [12395] agentloop-worker w5-...: ERROR:  deadlock detected"
    let open = line.find(" [")?;
    let close = line[open..].find("] ")? + open;
    let time = &line[..open];
    let pid = &line[open + 2..close];
    let rest = &line[close + 2..];
    Some((time, pid, rest))
}

fn app_of(rest: &str) -> &str {
    // "<app>: LEVEL:  message" — the app may be empty.
    for level in [": ERROR:", ": LOG:", ": DETAIL:", ": STATEMENT:", ": CONTEXT:", ": HINT:", ": FATAL:", ": WARNING:"] {
        if let Some(at) = rest.find(level) {
            return &rest[..at];
        }
    }
    ""
}

/// Parses the log text.
pub fn parse(text: &str) -> PgLog {
    let mut log = PgLog { lock_waits: text.matches("still waiting for").count() as u64, ..Default::default() };
    let mut apps: HashMap<String, String> = HashMap::new();
    for line in text.lines() {
        if let Some((_, pid, rest)) = prefix(line) {
            let app = app_of(rest);
            if !app.is_empty() {
                apps.insert(pid.to_owned(), app.to_owned());
            }
        }
    }
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.ends_with("ERROR:  deadlock detected") {
            continue;
        }
        let Some((time, pid, rest)) = prefix(line) else { continue };
        let app = app_of(rest);
        let folded = if app.starts_with("agentloop-worker ") { "agentloop-worker" } else { app };
        *log.victims.entry(if folded.is_empty() { "?".to_owned() } else { folded.to_owned() }).or_default() += 1;
        // The participants: "\tProcess <pid>: <statement>" lines after the DETAIL line.
        let mut participants = Vec::new();
        for next in lines.iter().skip(i + 1).take(12) {
            let t = next.trim_start();
            if prefix(next).is_some() && !next.contains("DETAIL:") {
                break;
            }
            if let Some(p) = t.strip_prefix("Process ")
                && let Some((ppid, stmt)) = p.split_once(": ")
                    && ppid.chars().all(|c| c.is_ascii_digit()) {
                        participants.push((ppid.to_owned(), stmt.to_owned()));
                    }
        }
        let involves_locker = participants.iter().any(|(_, s)| LOCKER_STATEMENTS.iter().any(|l| s.starts_with(l)));
        if !participants.is_empty() && !involves_locker {
            let who = participants
                .iter()
                .map(|(p, s)| {
                    let a = apps.get(p).map(String::as_str).unwrap_or("?");
                    format!("[{p} {a}] {}", s.chars().take(140).collect::<String>())
                })
                .collect::<Vec<_>>()
                .join(" <-> ");
            log.product_deadlocks.push(format!("{time}: victim [{pid} {app}]; {who}"));
        }
    }
    log
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_victims_and_product_deadlocks() {
        let text = "\
2026-12-01 22:06:08.552 UTC [1] agentloop-worker w5-1-a: ERROR:  deadlock detected
2026-12-01 22:06:08.552 UTC [1] agentloop-worker w5-1-a: DETAIL:  Process 1 waits for ShareLock on transaction 9; blocked by process 2.
\tProcess 2 waits for ShareLock on transaction 8; blocked by process 1.
\tProcess 1: UPDATE \"threads\" SET x = 1
\tProcess 2: SELECT \"runs\".\"id\" FROM \"runs\" FOR UPDATE
2026-12-01 22:06:08.552 UTC [1] agentloop-worker w5-1-a: HINT:  See server log for query details.
2026-12-01 22:06:09.000 UTC [2] agentloop-api: LOG:  process 2 still waiting for ShareLock on transaction 8 after 100.1 ms
2026-12-01 22:06:33.212 UTC [3] chaos-locker: ERROR:  deadlock detected
2026-12-01 22:06:33.212 UTC [3] chaos-locker: DETAIL:  Process 3 waits for ShareLock on transaction 7; blocked by process 1.
\tProcess 1 waits for ShareLock on transaction 6; blocked by process 3.
\tProcess 3: SELECT 1 FROM runs WHERE id = $1 FOR UPDATE
\tProcess 1: UPDATE \"threads\" SET x = 2
";
        let log = parse(text);
        assert_eq!(log.victims.get("agentloop-worker"), Some(&1));
        assert_eq!(log.victims.get("chaos-locker"), Some(&1));
        assert_eq!(log.lock_waits, 1);
        assert_eq!(log.product_deadlocks.len(), 1, "{:?}", log.product_deadlocks);
        assert!(log.product_deadlocks[0].contains("[2 agentloop-api]"), "{:?}", log.product_deadlocks);
    }
}
