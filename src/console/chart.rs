//! Small charts as inline SVG, rendered here: pure functions from a series to markup, so a
//! page needs no script and loads nothing (an inline `<svg>` is markup, not a resource, so the
//! Content-Security-Policy's `default-src 'none'` does not apply to it). They carry no `style`
//! attribute (`style-src 'self'` refuses inline styles): colours and fonts come from classes of
//! the console's stylesheet (`.chart…`), sizes from SVG attributes.
//!
//! A series is one value per bucket of a window, oldest first; `None` is a bucket without data
//! (a gap: nothing is drawn there, a line is broken), and so is a value that is not finite.
//! Values below zero are drawn at zero. Every text is escaped, producers' characters that could
//! disguise it (controls, bidi, zero-width) shown as their escapes ([`crate::text::escaped_char`]).

use std::fmt::Write as _;

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A line through the buckets' values, broken at gaps (a level: backlog, lag, a rate).
    Line,
    /// One bar per bucket (a count per bucket: dead letters).
    Bars,
}

/// What [`chart`] draws.
#[derive(Clone, Debug)]
pub struct Series<'a> {
    /// The chart's title, e.g. "Applied events per second".
    pub title: &'a str,
    /// What a value is in, after the number: "/s", "s", "".
    pub unit: &'a str,
    /// Line or bars.
    pub kind: Kind,
    /// One value per bucket, oldest first.
    pub points: &'a [Option<f64>],
    /// Under the first bucket, e.g. "14:05".
    pub start_label: &'a str,
    /// Under the last bucket, e.g. "15:05 UTC".
    pub end_label: &'a str,
}

const WIDTH: f64 = 360.0;
const HEIGHT: f64 = 140.0;
const LEFT: f64 = 44.0;
const RIGHT: f64 = WIDTH - 8.0;
const TOP: f64 = 24.0;
const BOTTOM: f64 = HEIGHT - 20.0;

/// The chart of `series`: title, last and highest value, a zero and a top axis label, the start
/// and end of the window, and the line or bars. An accessible summary is its `aria-label` and
/// `<title>` (a tooltip).
pub fn chart(series: &Series<'_>) -> String {
    let values = finite(series.points);
    let last = values.iter().rev().find_map(|v| *v);
    let max = values.iter().flatten().fold(0.0_f64, |m, v| m.max(*v));
    let top = nice_ceiling(max);
    let summary = match last {
        Some(last) => format!(
            "last {}, max {}",
            with_unit(last, series.unit),
            with_unit(max, series.unit)
        ),
        None => "no data in this window".to_owned(),
    };
    let label = format!(
        "{}: {summary} ({} to {})",
        series.title, series.start_label, series.end_label
    );
    let mut svg = String::with_capacity(2048);
    let _ = write!(
        svg,
        "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" \
         width=\"{WIDTH}\" height=\"{HEIGHT}\" role=\"img\" aria-label=\"{}\"><title>{}</title>",
        escape(&label),
        escape(&label)
    );
    let _ = write!(
        svg,
        "<text class=\"chart-title\" x=\"0\" y=\"14\">{}</text>\
         <text class=\"chart-value\" x=\"{WIDTH}\" y=\"14\" text-anchor=\"end\">{}</text>",
        escape(series.title),
        escape(&summary)
    );
    let _ = write!(
        svg,
        "<line class=\"chart-grid\" x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{RIGHT}\" y2=\"{TOP}\"/>\
         <line class=\"chart-axis\" x1=\"{LEFT}\" y1=\"{BOTTOM}\" x2=\"{RIGHT}\" y2=\"{BOTTOM}\"/>\
         <text class=\"chart-tick\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\
         <text class=\"chart-tick\" x=\"{}\" y=\"{BOTTOM}\" text-anchor=\"end\">0</text>\
         <text class=\"chart-tick\" x=\"{LEFT}\" y=\"{}\">{}</text>\
         <text class=\"chart-tick\" x=\"{RIGHT}\" y=\"{}\" text-anchor=\"end\">{}</text>",
        LEFT - 4.0,
        TOP + 4.0,
        escape(&format_value(top)),
        LEFT - 4.0,
        HEIGHT - 4.0,
        escape(series.start_label),
        HEIGHT - 4.0,
        escape(series.end_label),
    );
    if last.is_none() {
        let _ = write!(
            svg,
            "<text class=\"chart-empty\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">no data</text>",
            (LEFT + RIGHT) / 2.0,
            (TOP + BOTTOM) / 2.0 + 4.0
        );
    } else {
        let plot = Plot {
            left: LEFT,
            right: RIGHT,
            top: TOP,
            bottom: BOTTOM,
            max: top,
            n: values.len(),
        };
        match series.kind {
            Kind::Line => line(&mut svg, &plot, &values),
            Kind::Bars => bars(&mut svg, &plot, &values),
        }
    }
    svg.push_str("</svg>");
    svg
}

/// A small bar sparkline without axes (`width` × 24), for a table cell; `label` (escaped) is
/// its `aria-label` and tooltip.
pub fn sparkline(points: &[Option<f64>], label: &str, width: u32) -> String {
    let values = finite(points);
    let width = f64::from(width.max(8));
    let height = 24.0;
    let max = values.iter().flatten().fold(0.0_f64, |m, v| m.max(*v));
    let mut svg = String::with_capacity(1024);
    let _ = write!(
        svg,
        "<svg class=\"sparkline\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {width} {height}\" \
         width=\"{width}\" height=\"{height}\" role=\"img\" aria-label=\"{}\"><title>{}</title>\
         <line class=\"chart-axis\" x1=\"0\" y1=\"{}\" x2=\"{width}\" y2=\"{}\"/>",
        escape(label),
        escape(label),
        height - 0.5,
        height - 0.5
    );
    let plot = Plot {
        left: 0.0,
        right: width,
        top: 1.0,
        bottom: height - 1.0,
        max: if max > 0.0 { max } else { 1.0 },
        n: values.len(),
    };
    bars(&mut svg, &plot, &values);
    svg.push_str("</svg>");
    svg
}

/// Where a series is drawn.
struct Plot {
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    /// The value at `top`.
    max: f64,
    /// Buckets.
    n: usize,
}

impl Plot {
    fn step(&self) -> f64 {
        (self.right - self.left) / self.n.max(1) as f64
    }

    /// The middle of bucket `i`.
    fn x(&self, i: usize) -> f64 {
        self.left + (i as f64 + 0.5) * self.step()
    }

    fn y(&self, v: f64) -> f64 {
        let frac = (v.max(0.0) / self.max).clamp(0.0, 1.0);
        self.bottom - frac * (self.bottom - self.top)
    }
}

fn line(svg: &mut String, plot: &Plot, values: &[Option<f64>]) {
    let mut d = String::new();
    let mut dots = String::new();
    for (i, v) in values.iter().enumerate() {
        let Some(v) = v else { continue };
        let continues = i > 0 && values[i - 1].is_some();
        let ends = !matches!(values.get(i + 1), Some(Some(_)));
        let (x, y) = (plot.x(i), plot.y(*v));
        let _ = write!(d, "{}{x:.1} {y:.1}", if continues { " L" } else { " M" });
        if !continues && ends {
            // An isolated bucket: a segment of no length is invisible; mark it.
            let _ = write!(
                dots,
                "<circle class=\"chart-dot\" cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2\"/>"
            );
        }
    }
    if !d.is_empty() {
        let _ = write!(svg, "<path class=\"chart-line\" d=\"{}\"/>", d.trim_start());
    }
    svg.push_str(&dots);
}

fn bars(svg: &mut String, plot: &Plot, values: &[Option<f64>]) {
    let step = plot.step();
    let gap = if step > 3.0 { 1.0 } else { 0.0 };
    for (i, v) in values.iter().enumerate() {
        let Some(v) = v else { continue };
        if *v <= 0.0 {
            continue;
        }
        let y = plot.y(*v);
        // At least a pixel: a bucket with one arrival among thousands stays visible.
        let h = (plot.bottom - y).max(1.0);
        let _ = write!(
            svg,
            "<rect class=\"chart-bar\" x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\"/>",
            plot.left + i as f64 * step + gap / 2.0,
            plot.bottom - h,
            (step - gap).max(0.5),
        );
    }
}

/// The points with every value that is not finite made a gap.
fn finite(points: &[Option<f64>]) -> Vec<Option<f64>> {
    points.iter().map(|v| v.filter(|v| v.is_finite())).collect()
}

/// The smallest 1, 2 or 5 × 10ⁿ at or above `max` (1 for nothing above zero): the top of the
/// axis reads as a round number.
fn nice_ceiling(max: f64) -> f64 {
    if max.is_nan() || max <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(max.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        let nice = m * magnitude;
        if nice >= max {
            return if nice.is_finite() { nice } else { max };
        }
    }
    max
}

/// `value` with its unit ("4.2/s", "12 s", "3").
fn with_unit(value: f64, unit: &str) -> String {
    match unit {
        "" => format_value(value),
        u if u.starts_with('/') => format!("{}{u}", format_value(value)),
        u => format!("{} {u}", format_value(value)),
    }
}

/// A number short enough for a chart label: two decimals below 10, one below 100, whole below
/// 1 000, then k, M, G, T, P, E with three digits, then scientific; "-" for what is not finite.
pub fn format_value(value: f64) -> String {
    if !value.is_finite() {
        return "-".to_owned();
    }
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    let a = value.abs();
    if a < 10.0 {
        return trim(format!("{value:.2}"));
    }
    if a < 100.0 {
        return trim(format!("{value:.1}"));
    }
    if a < 1000.0 {
        return format!("{value:.0}");
    }
    let mut scaled = value;
    for suffix in ["k", "M", "G", "T", "P", "E"] {
        scaled /= 1000.0;
        if scaled.abs() < 999.5 {
            let digits = if scaled.abs() < 9.995 {
                2
            } else if scaled.abs() < 99.95 {
                1
            } else {
                0
            };
            return format!("{}{suffix}", trim(format!("{scaled:.digits$}")));
        }
    }
    format!("{value:.1e}")
}

/// `text` safe in SVG text and attribute values: `&`, `<`, `>`, quotes as references, and every
/// disguising character as its visible escape (the page's own pass would put an HTML `<span>`
/// there, which has no place in SVG).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => match crate::text::escaped_char(c) {
                Some(escape) => out.push_str(&escape),
                None => out.push(c),
            },
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(points: &[Option<f64>]) -> String {
        chart(&Series {
            title: "Backlog",
            unit: "",
            kind: Kind::Line,
            points,
            start_label: "14:00",
            end_label: "15:00 UTC",
        })
    }

    /// Every `<` of the markup opens an SVG element of the renderer's (no text made markup).
    fn assert_only_svg_elements(svg: &str) {
        for tag in svg.split('<').skip(1) {
            let name: String = tag
                .trim_start_matches('/')
                .chars()
                .take_while(|c| c.is_ascii_alphabetic())
                .collect();
            assert!(
                ["svg", "title", "text", "line", "path", "rect", "circle"].contains(&name.as_str()),
                "unexpected element {name:?} in {svg}"
            );
        }
        assert!(!svg.contains(" style="), "no style attribute: {svg}");
    }

    #[test]
    fn an_empty_series_says_no_data() {
        for points in [&[][..], &[None, None, None][..]] {
            let svg = series(points);
            assert!(svg.starts_with("<svg class=\"chart\""), "{svg}");
            assert!(svg.ends_with("</svg>"), "{svg}");
            assert!(svg.contains(">no data</text>"), "{svg}");
            assert!(svg.contains("no data in this window"), "{svg}");
            assert!(!svg.contains("<path"), "{svg}");
            assert_only_svg_elements(&svg);
        }
    }

    #[test]
    fn a_single_point_is_a_dot_with_its_value() {
        let svg = series(&[Some(7.0)]);
        assert!(svg.contains("<circle class=\"chart-dot\""), "{svg}");
        assert!(svg.contains("last 7, max 7"), "{svg}");
        // The axis tops at a round number at or above the max.
        assert!(svg.contains("text-anchor=\"end\">10</text>"), "{svg}");
        assert_only_svg_elements(&svg);
    }

    #[test]
    fn gaps_break_the_line() {
        let svg = series(&[Some(1.0), Some(2.0), None, Some(4.0), Some(3.0), None]);
        let d = svg
            .split("d=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap();
        assert_eq!(d.matches('M').count(), 2, "{d}");
        assert_eq!(d.matches('L').count(), 2, "{d}");
        assert!(!svg.contains("<circle"), "{svg}");
        // The last value is the newest bucket with data.
        assert!(svg.contains("last 3, max 4"), "{svg}");
        // Not finite is a gap too.
        let svg = series(&[Some(1.0), Some(f64::NAN), Some(f64::INFINITY), Some(2.0)]);
        assert_eq!(svg.matches("<circle").count(), 2, "{svg}");
        assert!(svg.contains("last 2, max 2"), "{svg}");
    }

    #[test]
    fn huge_and_negative_values_stay_inside_the_chart() {
        let svg = series(&[Some(1e300), Some(f64::MAX), Some(-5.0), Some(12_345_678.0)]);
        assert!(svg.contains("last 12.3M, max 1.8e308"), "{svg}");
        assert!(!svg.contains("inf") && !svg.contains("NaN"), "{svg}");
        // Every coordinate of the line is inside the plot.
        let d = svg.split("d=\"").nth(1).unwrap().split('"').next().unwrap();
        for y in d
            .split(['M', 'L'])
            .filter_map(|p| p.split_whitespace().nth(1))
        {
            let y: f64 = y.parse().unwrap();
            assert!((TOP..=BOTTOM).contains(&y), "{y} in {d}");
        }
        assert_only_svg_elements(&svg);
    }

    #[test]
    fn bars_draw_one_rect_per_bucket_above_zero() {
        let svg = chart(&Series {
            title: "Dead letters per minute",
            unit: "/min",
            kind: Kind::Bars,
            points: &[Some(0.0), Some(3.0), None, Some(1.0)],
            start_label: "a",
            end_label: "b",
        });
        assert_eq!(svg.matches("<rect class=\"chart-bar\"").count(), 2, "{svg}");
        assert!(svg.contains("last 1/min, max 3/min"), "{svg}");
        assert_only_svg_elements(&svg);
    }

    #[test]
    fn every_text_is_escaped() {
        let svg = chart(&Series {
            title: "<script>alert(1)</script> & \"x\" \u{202e}",
            unit: "s",
            kind: Kind::Line,
            points: &[Some(1.0)],
            start_label: "</svg><b>",
            end_label: "'",
        });
        assert!(svg.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;x&quot; \\u{202e}"));
        assert!(svg.contains("&lt;/svg&gt;&lt;b&gt;"), "{svg}");
        assert!(svg.contains("&#39;"), "{svg}");
        assert!(!svg.contains('\u{202e}'), "{svg}");
        assert_only_svg_elements(&svg);
        let spark = sparkline(&[Some(1.0), None, Some(2.0)], "<x> \u{200b}", 120);
        assert!(
            spark.contains("aria-label=\"&lt;x&gt; \\u{200b}\""),
            "{spark}"
        );
        assert_eq!(spark.matches("<rect").count(), 2, "{spark}");
        assert_only_svg_elements(&spark);
    }

    #[test]
    fn a_sparkline_of_nothing_is_an_empty_axis() {
        let spark = sparkline(&[], "no arrivals", 120);
        assert!(!spark.contains("<rect"), "{spark}");
        assert!(spark.contains("<line"), "{spark}");
        let spark = sparkline(&[Some(0.0); 96], "no arrivals", 120);
        assert!(!spark.contains("<rect"), "{spark}");
    }

    #[test]
    fn values_read_short() {
        for (v, want) in [
            (0.0, "0"),
            (0.25, "0.25"),
            (4.2, "4.2"),
            (12.34, "12.3"),
            (999.4, "999"),
            (1_234.0, "1.23k"),
            (12_345.0, "12.3k"),
            (999_999.0, "1M"),
            (2.5e9, "2.5G"),
            (7e18, "7E"),
            (3e21, "3.0e21"),
            (-1_500.0, "-1.5k"),
            (f64::NAN, "-"),
        ] {
            assert_eq!(format_value(v), want, "{v}");
        }
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(3.0), 5.0);
        assert_eq!(nice_ceiling(10.0), 10.0);
        assert_eq!(nice_ceiling(11.0), 20.0);
        assert_eq!(nice_ceiling(f64::MAX), f64::MAX);
    }
}
