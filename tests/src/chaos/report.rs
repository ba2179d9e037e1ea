//! The counts a chaos run prints: informative counts and invariants (an invariant with a
//! non-zero count is a violation), grouped in sections, with a few examples each.

use std::fmt::Write as _;

use serde_json::{Value, json};

/// One printed count.
#[derive(Debug, Clone)]
pub struct Line {
    pub name: String,
    pub count: u64,
    /// An invariant: any non-zero count is a violation.
    pub invariant: bool,
    /// Free text after the count (breakdowns).
    pub detail: String,
    /// Evidence (run ids, rows), the first few printed.
    pub examples: Vec<String>,
}

/// All sections of a run's report.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub header: String,
    pub sections: Vec<(String, Vec<Line>)>,
    pub notes: Vec<String>,
}

impl Report {
    /// Adds a section.
    pub fn section(&mut self, title: &str) -> &mut Vec<Line> {
        self.sections.push((title.to_owned(), Vec::new()));
        &mut self.sections.last_mut().expect("just pushed").1
    }

    /// Invariants with a non-zero count.
    pub fn violated(&self) -> Vec<&Line> {
        self.sections.iter().flat_map(|(_, lines)| lines).filter(|l| l.invariant && l.count > 0).collect()
    }

    /// The table, `examples` evidence lines per violated invariant.
    pub fn table(&self, examples: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}", self.header);
        for (title, lines) in &self.sections {
            let _ = writeln!(out, "-- {title} {}", "-".repeat(60usize.saturating_sub(title.len())));
            for l in lines {
                let mark = match (l.invariant, l.count) {
                    (false, _) => "      ",
                    (true, 0) => "  ok  ",
                    (true, _) => "  FAIL",
                };
                let _ = writeln!(out, "{mark} {:<44} {:>7}  {}", l.name, l.count, l.detail);
            }
        }
        let violated = self.violated();
        if violated.is_empty() {
            let _ = writeln!(out, "RESULT: all invariants hold");
        } else {
            let _ = writeln!(out, "RESULT: {} invariant(s) violated", violated.len());
            for l in violated {
                let _ = writeln!(out, "  {} ({}):", l.name, l.count);
                for e in l.examples.iter().take(examples) {
                    let _ = writeln!(out, "    - {e}");
                }
                if l.examples.len() > examples {
                    let _ = writeln!(out, "    ... {} more in report.json", l.examples.len() - examples);
                }
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "note: {n}");
        }
        out
    }

    /// The whole report as JSON (every example).
    pub fn json(&self) -> Value {
        json!({
            "header": self.header,
            "sections": self.sections.iter().map(|(t, lines)| json!({
                "title": t,
                "lines": lines.iter().map(|l| json!({
                    "name": l.name, "count": l.count, "invariant": l.invariant, "detail": l.detail, "examples": l.examples,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "notes": self.notes,
        })
    }
}

/// An informative count.
pub fn info(name: &str, count: u64, detail: impl Into<String>) -> Line {
    Line { name: name.to_owned(), count, invariant: false, detail: detail.into(), examples: Vec::new() }
}

/// An invariant count with its evidence.
pub fn inv(name: &str, examples: Vec<String>, detail: impl Into<String>) -> Line {
    Line { name: name.to_owned(), count: examples.len() as u64, invariant: true, detail: detail.into(), examples }
}

/// An invariant counted per item, with one example per group (e.g. per run) so that one run
/// repeating a fault a thousand times does not drown the others.
pub fn inv_grouped(name: &str, items: Vec<(String, String)>, detail: impl Into<String>) -> Line {
    let count = items.len() as u64;
    let mut order: Vec<String> = Vec::new();
    let mut groups: std::collections::HashMap<String, (String, usize)> = std::collections::HashMap::new();
    for (group, example) in items {
        match groups.get_mut(&group) {
            Some(g) => g.1 += 1,
            None => {
                order.push(group.clone());
                groups.insert(group, (example, 1));
            }
        }
    }
    let examples = order
        .into_iter()
        .map(|g| {
            let (example, n) = &groups[&g];
            if *n > 1 { format!("{example} (+{} more like it in this run)", n - 1) } else { example.clone() }
        })
        .collect();
    Line { name: name.to_owned(), count, invariant: true, detail: detail.into(), examples }
}
