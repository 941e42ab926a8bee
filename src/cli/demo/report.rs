//! The report on stdout once the sample is drained: the dead letters and why, a few rows of
//! each read model table, the metrics URL and the commands to try; and the number and text
//! formatting the demo's output shares.

use super::args::Addresses;
use std::io::Write;

use chrono::Utc;
use uuid::Uuid;

use super::args::DemoArgs;
use super::cli_hint::CliHint;
use super::config::{DatabaseSource, DemoConfig};
use super::sample::{timestamp, POISON_EVENTS};
use crate::cli::output;
use crate::store::{DeadLetter, Store};

/// The dead letters, the read model, the metrics URL and the commands to try, on stdout.
pub(super) async fn print_report(
    demo: &DemoConfig,
    args: &DemoArgs,
    dead: &[DeadLetter],
    earlier: usize,
    max_attempts: u32,
    store: &Store,
    addrs: Addresses,
) {
    let http_addr = addrs.http;
    let mut out = String::new();
    let mut line = |text: &str| {
        out.push_str(text);
        out.push('\n');
    };

    line("");
    line(&format!(
        "Dead letters: {} event(s) a perspective gave up on",
        dead.len()
    ));
    let mut t = output::table(&[
        "Perspective",
        "Position",
        "Event",
        "Stream",
        "Reason",
        "Claims",
        "Last error",
    ]);
    for d in dead {
        t.add_row(vec![
            d.perspective_name.clone(),
            d.global_position.to_string(),
            d.event_type.clone().unwrap_or_else(|| "?".into()),
            short_id(d.stream_id),
            d.failure_reason.clone(),
            d.attempts_when_dlq.to_string(),
            last_error(d),
        ]);
    }
    output::align_right(&mut t, &[1, 5]);
    line(&t.to_string());
    if earlier > 0 {
        line(&format!(
            "(and {earlier} open dead letter(s) from earlier runs or other perspectives: `dlq list` shows them all)"
        ));
    }
    line(&format!(
        "What happened: {POISON_EVENTS} OrderPaid events carry amounts revenue_by_day cannot \
         apply: three producer bugs, three error groups (below). Its statement failed on each of \
         their {max_attempts} claims (parked with backoff in between), so the {} claim \
         dead-lettered them; the refund of the order paid without an amount waited behind its \
         payment (a blocked lane) until then, and the rest of those streams and the other \
         perspectives carried on.",
        ordinal(max_attempts + 1)
    ));
    let groups = store.error_groups(None).await.unwrap_or_default();
    let groups: Vec<_> = groups
        .into_iter()
        .filter(|g| {
            dead.iter()
                .any(|d| d.error_fingerprint.as_deref() == Some(&g.fingerprint))
        })
        .collect();
    if !groups.is_empty() {
        let mut t = output::table(&[
            "Group",
            "Perspective",
            "SQLSTATE",
            "Count",
            "Error (masked)",
        ]);
        for g in &groups {
            t.add_row(vec![
                g.fingerprint.clone(),
                g.perspective_name.clone(),
                g.sqlstate.clone().unwrap_or_else(|| "-".to_owned()),
                g.count.to_string(),
                output::shorten(&g.message, 70),
            ]);
        }
        output::align_right(&mut t, &[3]);
        line("");
        line(&format!("Error groups (dlq groups):\n{t}"));
    }

    for section in read_model(store).await {
        line("");
        line(&section);
    }

    line("");
    line(&format!(
        "Metrics: http://{http_addr}/metrics (health: http://{http_addr}/healthz, http://{http_addr}/readyz)"
    ));
    if let Some(console) = addrs.console {
        line(&format!(
            "Console: http://{console}/ (the dead letters above, in a browser)"
        ));
    }
    line("");
    let cli = CliHint::new(demo);
    let throwaway = matches!(demo.database, DatabaseSource::Throwaway(_));
    match (throwaway, args.once) {
        (true, true) => line(
            "Try the operator CLI. With --once the demo has stopped, and its throwaway database \
             with it: run the demo without --once and use these commands from another terminal \
             while it keeps running.",
        ),
        (true, false) => line(
            "Try the operator CLI from another terminal while the demo keeps running (its \
             throwaway database goes away when the demo stops):",
        ),
        (false, _) => line("Try the operator CLI:"),
    }
    for note in &cli.notes {
        line(&format!("  ({note})"));
    }
    let (position, perspective) = dead
        .first()
        .map(|d| (d.global_position, d.perspective_name.as_str()))
        .unwrap_or((1, "revenue_by_day"));
    let retries = max_attempts + 1;
    let too_large = dead
        .iter()
        .find(|d| {
            d.error_text
                .as_deref()
                .is_some_and(|e| e.contains("numeric field overflow"))
        })
        .and_then(|d| d.error_fingerprint.clone())
        .unwrap_or_else(|| "FINGERPRINT".to_owned());
    for (command, comment) in [
        ("status".to_owned(), ""),
        (
            "status --blocked".to_owned(),
            "  # lanes waiting behind a failing head (none once it is dead-lettered)",
        ),
        (
            "dlq groups".to_owned(),
            "  # the dead letters by error: three bugs",
        ),
        ("dlq list".to_owned(), ""),
        (format!("dlq inspect {position}"), ""),
        (
            format!("dlq replay {position} --perspective {perspective}"),
            "  # fails again: the amount is still not a number",
        ),
        (
            format!("dlq replay {position} --perspective {perspective} --dry-run"),
            "  # what a replay would write, or its error; nothing is written",
        ),
        ("dlq requeue --all --dry-run".to_owned(), ""),
        (
            format!("dlq requeue --group {too_large} --dry-run"),
            "  # the too-large amounts; widen the column first (below)",
        ),
        (
            format!("dlq requeue {position} --perspective {perspective} --yes"),
            "  # back to the daemon, which dead-letters it again",
        ),
        (
            format!("dlq purge {position} --perspective {perspective} --yes"),
            "",
        ),
    ] {
        line(&format!("  {}{comment}", cli.command(&command)));
    }
    line("");
    line(
        "Fix a group and requeue it: the too-large amounts fit once revenue_by_day's column is \
         wider. With psql on the demo's database:",
    );
    line("  ALTER TABLE demo.revenue_by_day ALTER COLUMN revenue TYPE numeric(20,2);");
    line(&format!(
        "  then {}   # dlq groups no longer lists it",
        cli.command(&format!("dlq requeue --group {too_large} --yes"))
    ));
    if !args.once {
        // Written out by hand to keep the keys in a readable order.
        let order_id = Uuid::new_v4();
        let paid = format!(
            r#"{{"stream_id":"{order_id}","event_type":"OrderPaid","data":{{"order_id":"{order_id}","amount":"19,99","currency":"EUR","method":"card","paid_at":"{}"}}}}"#,
            timestamp(Utc::now())
        );
        line("");
        line(&format!(
            "Append another unreadable payment and see it dead-lettered after {retries} claims, \
             a few seconds later, in `dlq list`:"
        ));
        line(&format!("  echo '{paid}' | {}", cli.command("append")));
    }
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(out.as_bytes());
    let _ = stdout.flush();
}

/// Day, currency, orders paid, revenue, refunds.
type RevenueRow = (String, String, i32, String, String);

/// A few rows of each read model table, as printable sections.
async fn read_model(store: &Store) -> Vec<String> {
    let mut sections = Vec::new();
    let pool = store.pool();

    let by_status: Result<Vec<(String, i64, String)>, sqlx::Error> = sqlx::query_as(
        "SELECT status, count(*), \
                round(100.0 * count(*) / sum(count(*)) OVER (), 1)::text || '%' \
         FROM demo.order_summary GROUP BY status \
         ORDER BY array_position(ARRAY['placed','paid','shipped','delivered','cancelled'], status), \
                  status",
    )
    .fetch_all(pool)
    .await;
    sections.push(match by_status {
        Ok(rows) => {
            let total: i64 = rows.iter().map(|r| r.1).sum();
            let mut t = output::table(&["Status", "Orders", "Share"]);
            for (status, orders, share) in rows {
                t.add_row(vec![status, thousands(orders as u64), share]);
            }
            output::align_right(&mut t, &[1, 2]);
            format!(
                "Orders by status (demo.order_summary, {} orders):\n{t}",
                thousands(total as u64)
            )
        }
        Err(e) => format!("(cannot read demo.order_summary: {e})"),
    });

    let revenue: Result<Vec<RevenueRow>, sqlx::Error> = sqlx::query_as(
        "SELECT r.day::text, r.currency, r.orders, r.revenue::text, r.refunds::text \
         FROM demo.revenue_by_day r ORDER BY r.revenue DESC, r.day DESC LIMIT 5",
    )
    .fetch_all(pool)
    .await;
    sections.push(match revenue {
        Ok(rows) => {
            let mut t = output::table(&["Day", "Currency", "Orders paid", "Revenue", "Refunds"]);
            for (day, currency, orders, revenue, refunds) in rows {
                t.add_row(vec![day, currency, orders.to_string(), revenue, refunds]);
            }
            output::align_right(&mut t, &[2, 3, 4]);
            format!("Top 5 days by revenue (demo.revenue_by_day):\n{t}")
        }
        Err(e) => format!("(cannot read demo.revenue_by_day: {e})"),
    });

    let customers: Result<Vec<(Uuid, i32, i32, String)>, sqlx::Error> = sqlx::query_as(
        "SELECT customer_id, orders, cancelled, \
                to_char(last_order_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI') \
         FROM demo.customer_orders ORDER BY orders DESC, last_order_at DESC LIMIT 5",
    )
    .fetch_all(pool)
    .await;
    sections.push(match customers {
        Ok(rows) => {
            let mut t = output::table(&["Customer", "Orders", "Cancelled", "Last order (UTC)"]);
            for (customer, orders, cancelled, last) in rows {
                t.add_row(vec![
                    short_id(customer),
                    orders.to_string(),
                    cancelled.to_string(),
                    last,
                ]);
            }
            output::align_right(&mut t, &[1, 2]);
            format!("Top 5 customers (demo.customer_orders):\n{t}")
        }
        Err(e) => format!("(cannot read demo.customer_orders: {e})"),
    });
    sections
}

/// The error a perspective last reported for a dead letter, on one short line.
fn last_error(d: &DeadLetter) -> String {
    let text = d.error_text.as_deref().unwrap_or("");
    let error = text
        .lines()
        .find_map(|l| l.strip_prefix("last error: "))
        .or_else(|| text.lines().next())
        .unwrap_or("");
    truncate(error, 72)
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut short: String = text.chars().take(max - 1).collect();
        short.push('…');
        short
    }
}

fn short_id(id: Uuid) -> String {
    id.simple().to_string()[..8].to_owned()
}

/// `1234567` → `1,234,567`.
pub(super) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(ordinal(4), "4th");
        assert_eq!(ordinal(11), "11th");
        assert_eq!(ordinal(21), "21st");
        assert_eq!(ordinal(2), "2nd");
        assert_eq!(truncate("abcdef", 4), "abc…");
    }
}
