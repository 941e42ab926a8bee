//! The charts of the overview, a perspective's page and the error groups (docs/operations.md,
//! "The metric history"): which window (`?window=1h|6h|24h`), its buckets, and the series read
//! from `wh_metric_samples` and `wh_dead_letters`, rendered by [`super::chart`].
//!
//! A window of samples ends at the last complete minute (the current minute is still being
//! written: its applied count would read low); the dead letters' arrivals on the groups page
//! include the current minute (each arrival is a row, exact from the first).

use std::time::Duration;

use chrono::{DateTime, DurationRound as _, Utc};

use super::chart::{self, Kind, Series};
use super::error::PageError;
use super::view;
use crate::store::{Store, StoreError, Window};

/// A chart window: how far back, in how many buckets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Span {
    /// The last hour in 60 one-minute buckets (the default).
    #[default]
    Hour,
    /// The last 6 hours in 72 five-minute buckets.
    SixHours,
    /// The last 24 hours (all the history keeps) in 96 fifteen-minute buckets.
    Day,
}

impl Span {
    /// Every window, as the links offer them.
    pub const ALL: [Span; 3] = [Span::Hour, Span::SixHours, Span::Day];

    /// The `window` parameter: absent or empty is the default; anything but `1h`, `6h` and
    /// `24h` is refused (400), so a typo is not silently a different chart.
    pub fn parse(param: Option<&str>) -> Result<Span, PageError> {
        match param.map(str::trim).unwrap_or("") {
            "" => Ok(Span::default()),
            "1h" => Ok(Span::Hour),
            "6h" => Ok(Span::SixHours),
            "24h" => Ok(Span::Day),
            other => Err(PageError::BadRequest(format!(
                "window must be 1h, 6h or 24h, not {:?}.",
                crate::text::one_line(&crate::text::cap_at(other, 32))
            ))),
        }
    }

    /// Its value of `window`.
    pub fn param(self) -> &'static str {
        match self {
            Span::Hour => "1h",
            Span::SixHours => "6h",
            Span::Day => "24h",
        }
    }

    /// Its value of `window` in a link: empty for the default (so the plain URL stays plain).
    pub fn link_param(self) -> &'static str {
        if self == Span::default() {
            ""
        } else {
            self.param()
        }
    }

    /// "last hour", …
    pub fn label(self) -> &'static str {
        match self {
            Span::Hour => "last hour",
            Span::SixHours => "last 6 hours",
            Span::Day => "last 24 hours",
        }
    }

    /// How long one bucket is.
    pub fn bucket(self) -> Duration {
        Duration::from_secs(match self {
            Span::Hour => 60,
            Span::SixHours => 5 * 60,
            Span::Day => 15 * 60,
        })
    }

    /// How many buckets.
    pub fn buckets(self) -> i64 {
        match self {
            Span::Hour => 60,
            Span::SixHours => 72,
            Span::Day => 96,
        }
    }

    /// The window ending at the minute `now` is in (`with_current`: at the end of that minute).
    pub fn window(self, now: DateTime<Utc>, with_current: bool) -> Window {
        let minute = now
            .duration_trunc(chrono::Duration::minutes(1))
            .unwrap_or(now);
        let end = if with_current {
            minute + chrono::Duration::minutes(1)
        } else {
            minute
        };
        let span = self.bucket().as_secs() as i64 * self.buckets();
        Window {
            start: end - chrono::Duration::seconds(span),
            bucket: self.bucket(),
            buckets: self.buckets(),
        }
    }

    /// A time on the axis: the hour and minute, with the day for the 24-hour window.
    fn at(self, t: DateTime<Utc>) -> String {
        match self {
            Span::Day => t.format("%m-%d %H:%M").to_string(),
            _ => t.format("%H:%M").to_string(),
        }
    }
}

/// A link to the same page with another window.
pub struct WindowLink {
    /// "1h", …
    pub label: &'static str,
    pub href: String,
    /// The window shown now.
    pub current: bool,
}

/// The window links of `path`, keeping `keep` (the page's other parameters).
pub fn links(path: &str, current: Span, keep: &[(&str, &str)]) -> Vec<WindowLink> {
    Span::ALL
        .into_iter()
        .map(|span| {
            let mut params = vec![("window", span.link_param())];
            params.extend_from_slice(keep);
            WindowLink {
                label: span.param(),
                href: view::href(path, &params),
                current: span == current,
            }
        })
        .collect()
}

/// The four charts of a page, rendered: applied events per second, backlog, lag, dead letters
/// per minute; of one perspective or (`None`) of all (`names`: the perspectives whose dead
/// letters count).
pub async fn charts(
    store: &Store,
    perspective: Option<&str>,
    names: &[String],
    span: Span,
    now: DateTime<Utc>,
) -> Result<Vec<String>, StoreError> {
    let window = span.window(now, false);
    let samples = store.sample_buckets(perspective, window).await?;
    let arrivals = store.dead_letter_arrivals(names, window).await?;
    let n = usize::try_from(window.buckets).unwrap_or(0);
    let bucket_minutes = window.bucket.as_secs() as f64 / 60.0;
    let mut applied = vec![None; n];
    let mut backlog = vec![None; n];
    let mut lag = vec![None; n];
    for s in &samples {
        let Some(i) = index(s.bucket, n) else {
            continue;
        };
        if s.minutes > 0 {
            applied[i] = Some(s.applied as f64 / (s.minutes as f64 * 60.0));
        }
        backlog[i] = s.backlog.map(|b| b as f64);
        lag[i] = s.lag_seconds;
    }
    // Every bucket is known for dead letters: no row is none arrived.
    let mut dead = vec![Some(0.0); n];
    for a in &arrivals {
        if let Some(i) = index(a.bucket, n) {
            dead[i] = Some(a.count as f64 / bucket_minutes);
        }
    }
    let start = span.at(window.start);
    let end = format!("{} UTC", span.at(window.end()));
    let draw = |title: &str, unit: &str, kind: Kind, points: &[Option<f64>]| {
        chart::chart(&Series {
            title,
            unit,
            kind,
            points,
            start_label: &start,
            end_label: &end,
        })
    };
    Ok(vec![
        draw("Applied events per second", "/s", Kind::Line, &applied),
        draw("Backlog (work rows)", "", Kind::Line, &backlog),
        draw("Lag: oldest pending (s)", "s", Kind::Line, &lag),
        draw("Dead letters per minute", "/min", Kind::Bars, &dead),
    ])
}

/// Each error group's arrivals in `span` (the current minute included), as a sparkline per
/// fingerprint, with the number that arrived; one statement.
pub async fn group_sparklines(
    store: &Store,
    perspective: Option<&str>,
    span: Span,
    now: DateTime<Utc>,
) -> Result<std::collections::HashMap<String, (i64, String)>, StoreError> {
    let window = span.window(now, true);
    let n = usize::try_from(window.buckets).unwrap_or(0);
    let mut per_group: std::collections::HashMap<String, Vec<Option<f64>>> = Default::default();
    for row in store.group_arrivals(perspective, window).await? {
        let points = per_group
            .entry(row.fingerprint)
            .or_insert_with(|| vec![Some(0.0); n]);
        if let Some(i) = index(row.bucket, n) {
            points[i] = Some(row.count as f64);
        }
    }
    let minutes = window.bucket.as_secs() / 60;
    Ok(per_group
        .into_iter()
        .map(|(fp, points)| {
            let total: f64 = points.iter().flatten().sum();
            let label = format!(
                "{} arrived in the {} ({minutes}-minute bars)",
                total as i64,
                span.label()
            );
            (fp, (total as i64, chart::sparkline(&points, &label, 144)))
        })
        .collect())
}

/// The sparkline of a group with no arrival in the window.
pub fn quiet_sparkline(span: Span) -> String {
    let n = usize::try_from(span.buckets()).unwrap_or(0);
    chart::sparkline(
        &vec![Some(0.0); n],
        &format!("none arrived in the {}", span.label()),
        144,
    )
}

/// Bucket `b` as an index of `n` buckets, if it is one.
fn index(b: i64, n: usize) -> Option<usize> {
    usize::try_from(b).ok().filter(|i| *i < n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_strictly_and_end_on_minutes() {
        assert_eq!(Span::parse(None).unwrap(), Span::Hour);
        assert_eq!(Span::parse(Some("")).unwrap(), Span::Hour);
        assert_eq!(Span::parse(Some("6h")).unwrap(), Span::SixHours);
        assert_eq!(Span::parse(Some("24h")).unwrap(), Span::Day);
        for bad in ["2h", "1H", "<b>", "24hours"] {
            assert!(
                matches!(Span::parse(Some(bad)), Err(PageError::BadRequest(_))),
                "{bad}"
            );
        }
        let now: DateTime<Utc> = "2026-12-02T15:10:42.5Z".parse().unwrap();
        let w = Span::Hour.window(now, false);
        assert_eq!(w.start.to_rfc3339(), "2026-12-02T14:10:00+00:00");
        assert_eq!(w.end().to_rfc3339(), "2026-12-02T15:10:00+00:00");
        let w = Span::Day.window(now, true);
        assert_eq!(w.end().to_rfc3339(), "2026-12-02T15:11:00+00:00");
        assert_eq!(w.start.to_rfc3339(), "2026-12-01T15:11:00+00:00");
        for span in Span::ALL {
            assert_eq!(
                span.bucket().as_secs() as i64 * span.buckets(),
                match span {
                    Span::Hour => 3600,
                    Span::SixHours => 6 * 3600,
                    Span::Day => 24 * 3600,
                }
            );
        }
    }
}
