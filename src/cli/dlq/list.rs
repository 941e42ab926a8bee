//! `vantage dlq list`: open dead letters grouped by perspective.

use serde_json::{json, Value};

use super::{msg, Ctx, ListArgs};
use crate::cli::output::{self, Failure};
use crate::dlq::check_perspective;
use crate::store::DeadLetter;

/// Positions shown per table row; the JSON lists them all and the Count column counts them
/// all, so nothing is hidden, only abbreviated.
const MAX_POSITIONS_SHOWN: usize = 12;

/// One perspective's open dead letters.
struct Group<'a> {
    perspective: &'a str,
    letters: Vec<&'a DeadLetter>,
}

impl Group<'_> {
    fn positions(&self) -> Vec<i64> {
        self.letters.iter().map(|d| d.global_position).collect()
    }

    /// The reason of the most recent dead letter (latest `dead_lettered_at`, then position).
    fn last_reason(&self) -> &str {
        self.letters
            .iter()
            .max_by_key(|d| (d.dead_lettered_at, d.global_position))
            .map(|d| d.failure_reason.as_str())
            .unwrap_or("")
    }
}

pub(super) async fn run(ctx: &Ctx<'_>, args: ListArgs) -> Result<Value, Failure> {
    let perspective = args.perspective.as_deref();
    check_perspective(ctx.store, perspective).await?;
    let letters = ctx
        .store
        .open_dead_letters(perspective)
        .await
        .map_err(|e| output::store_failure(&e))?;

    // open_dead_letters is ordered by perspective, then position.
    let mut groups: Vec<Group<'_>> = Vec::new();
    for d in &letters {
        match groups.last_mut() {
            Some(g) if g.perspective == d.perspective_name => g.letters.push(d),
            _ => groups.push(Group {
                perspective: &d.perspective_name,
                letters: vec![d],
            }),
        }
    }

    if groups.is_empty() {
        ctx.ui.say(msg::none_listed());
    } else {
        let mut t = output::table(&[
            "Perspective",
            "Dead-lettered positions",
            "Count",
            "Last reason",
        ]);
        for g in &groups {
            t.add_row(vec![
                g.perspective.to_owned(),
                abbreviate(&g.positions()),
                g.letters.len().to_string(),
                g.last_reason().to_owned(),
            ]);
        }
        output::align_right(&mut t, &[2]);
        ctx.ui.say(t);
        ctx.ui.say(msg::listed(letters.len(), groups.len()));
    }

    let perspectives: Vec<Value> = groups
        .iter()
        .map(|g| {
            json!({
                "count": g.letters.len(),
                "last_reason": g.last_reason(),
                "perspective": g.perspective,
                "positions": g.positions(),
            })
        })
        .collect();
    Ok(json!({ "perspectives": perspectives }))
}

/// `3, 7, 12` or, past [`MAX_POSITIONS_SHOWN`], `3, 7, ... (+40 more)`.
fn abbreviate(positions: &[i64]) -> String {
    let shown: Vec<String> = positions
        .iter()
        .take(MAX_POSITIONS_SHOWN)
        .map(i64::to_string)
        .collect();
    let mut text = shown.join(", ");
    if positions.len() > MAX_POSITIONS_SHOWN {
        text.push_str(&format!(
            ", ... (+{} more)",
            positions.len() - MAX_POSITIONS_SHOWN
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_position_lists_are_abbreviated_not_hidden() {
        assert_eq!(abbreviate(&[3, 7]), "3, 7");
        let many: Vec<i64> = (1..=15).collect();
        assert_eq!(
            abbreviate(&many),
            "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, ... (+3 more)"
        );
    }
}
