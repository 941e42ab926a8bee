//! The templates (askama, under `templates/console/`, compiled into the binary and escaped
//! as HTML), the stylesheet, and how values are shown.

use askama::Template;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, Utc};

pub use super::flash::Flash;
pub use super::history::WindowLink;

/// The console's one stylesheet, embedded in the binary (no CDN, nothing external).
pub const STYLESHEET: &str = include_str!("../../templates/console/console.css");

/// `GET /console.css`.
pub async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// Renders a template; a template that cannot render (it cannot fail on these types, but the
/// API says it may) becomes a plain message rather than a panic.
pub fn render(template: &impl Template) -> Html<String> {
    Html(visible(template.render().unwrap_or_else(|e| {
        tracing::error!(error = %e, "console: a template failed to render");
        "The console could not render this page.".to_owned()
    })))
}

/// A rendered page with every control, bidi and zero-width character made visible, wherever
/// a value put it (event types, error texts, payloads, filters, …), as the CLI shows them
/// ([`crate::text::escaped_char`]): in text, the escape in a marked span
/// (`<span class="esc" title="U+202E">\u{202e}</span>`), so a right-to-left override cannot
/// make one event type read as another; inside a tag (an attribute value: a hidden field that
/// repeats a filter, an input's value) a character reference (`&#x202e;`), which keeps the
/// value exactly what it was; in `<title>` and `<textarea>`, which hold no markup, the escape
/// alone. The templates hold no such character, and askama escapes `<` and `>` in values, so
/// every `<` and `>` of the page is the templates' markup.
pub fn visible(html: String) -> String {
    use std::fmt::Write as _;
    if !html.chars().any(|c| crate::text::escaped_char(c).is_some()) {
        return html;
    }
    let mut out = String::with_capacity(html.len() + 256);
    let mut in_tag = false;
    // Inside an element whose content is text only (`<title>`, `<textarea>`).
    let mut text_only = false;
    for (i, c) in html.char_indices() {
        match c {
            '<' => {
                in_tag = true;
                let name: String = html[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '/')
                    .map(|c| c.to_ascii_lowercase())
                    .collect();
                match name.as_str() {
                    "title" | "textarea" => text_only = true,
                    "/title" | "/textarea" => text_only = false,
                    _ => {}
                }
                out.push(c);
            }
            '>' => {
                in_tag = false;
                out.push(c);
            }
            c => match crate::text::escaped_char(c) {
                None => out.push(c),
                Some(_) if in_tag => {
                    let _ = write!(out, "&#x{:x};", u32::from(c));
                }
                Some(escape) if text_only => out.push_str(&escape),
                Some(escape) => {
                    let _ = write!(
                        out,
                        "<span class=\"esc\" title=\"U+{:04X}\">{escape}</span>",
                        u32::from(c)
                    );
                }
            },
        }
    }
    out
}

/// A time as the CLI shows it: RFC 3339, UTC, milliseconds.
pub fn at(t: &DateTime<Utc>) -> String {
    crate::present::timestamp(t)
}

/// An age as the CLI shows it (`1h 2m`).
pub fn age(seconds: f64) -> String {
    crate::present::human_age(seconds)
}

/// `/dead-letters?…` with these parameters (empty values left out), form-encoded.
pub fn dead_letters_href(params: &[(&str, &str)]) -> String {
    href("/dead-letters", params)
}

/// `path?…` with these parameters (empty values left out), form-encoded.
pub fn href(path: &str, params: &[(&str, &str)]) -> String {
    let mut query = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in params {
        if !v.is_empty() {
            query.append_pair(k, v);
        }
    }
    let query = query.finish();
    if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{query}")
    }
}

/// The permalink of a dead letter: `/dead-letters/{position}/{perspective}`.
pub fn detail_href(position: i64, perspective: &str) -> String {
    let name: String = url::form_urlencoded::byte_serialize(perspective.as_bytes()).collect();
    // form encoding writes a space as `+`, which a path does not decode.
    format!("/dead-letters/{position}/{}", name.replace('+', "%20"))
}

/// A perspective's page: `/perspectives/{name}`.
pub fn perspective_href(name: &str) -> String {
    let name: String = url::form_urlencoded::byte_serialize(name.as_bytes()).collect();
    // form encoding writes a space as `+`, which a path does not decode.
    format!("/perspectives/{}", name.replace('+', "%20"))
}

/// One `<option>` of a filter.
pub struct Choice {
    /// Its value (and label).
    pub value: String,
    /// Whether the current filter has it.
    pub selected: bool,
}

impl Choice {
    /// The options `values`, `current` selected.
    pub fn list<'a>(values: impl IntoIterator<Item = &'a str>, current: &str) -> Vec<Choice> {
        values
            .into_iter()
            .map(|v| Choice {
                value: v.to_owned(),
                selected: v == current,
            })
            .collect()
    }
}

/// `templates/console/error.html`.
#[derive(Template)]
#[template(path = "console/error.html")]
pub struct ErrorPage<'a> {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub status: u16,
    pub title: &'a str,
    pub message: &'a str,
}

/// A row of the overview's perspective table.
pub struct PerspectiveRow {
    pub name: String,
    /// Its page (`/perspectives/{name}`).
    pub href: String,
    pub pending: i64,
    pub leased: i64,
    pub parked: i64,
    pub dead_lettered: i64,
    pub dead_letters_href: String,
    pub oldest_age: String,
    pub lag_seconds: String,
    pub blocked_lanes: i64,
    pub blocked_events: i64,
    pub blocked_href: String,
    /// `paused since … by …: reason`, when paused.
    pub paused: Option<String>,
}

/// A row of the overview's instance table.
pub struct InstanceRow {
    pub instance_id: String,
    pub host_name: String,
    pub process_id: i32,
    pub version: String,
    pub started_at: String,
    pub heartbeat_age: String,
}

/// `templates/console/overview.html`.
#[derive(Template)]
#[template(path = "console/overview.html")]
pub struct OverviewPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub now: String,
    pub refresh_seconds: Option<u32>,
    pub refresh_every: u32,
    /// The same page with the auto-refresh paused, and resumed (the window kept).
    pub pause_href: String,
    pub resume_href: String,
    pub perspectives: Vec<PerspectiveRow>,
    pub versions: Vec<VersionRow>,
    pub instances: Vec<InstanceRow>,
    pub history: HistoryView,
}

/// The charts of a page and the links to its other windows.
pub struct HistoryView {
    /// "last hour", …
    pub label: &'static str,
    pub links: Vec<WindowLink>,
    /// Rendered inline SVG ([`super::chart`]), markup the templates insert as it is.
    pub charts: Vec<String>,
}

/// `templates/console/perspective.html`: one perspective's numbers, versions and charts.
#[derive(Template)]
#[template(path = "console/perspective.html")]
pub struct PerspectivePage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub now: String,
    pub p: PerspectiveRow,
    pub versions: Vec<VersionRow>,
    pub history: HistoryView,
}

/// A row of the overview's versions table (docs/versions.md): one version of a versioned
/// perspective.
pub struct VersionRow {
    pub perspective: String,
    pub version: i32,
    pub state: String,
    pub live: bool,
    pub behind: i64,
    pub backfill: String,
    pub schema: String,
    pub since: String,
}

/// The list's filter form, as the user typed it.
#[derive(Default)]
pub struct FilterForm {
    /// An error fingerprint (from the groups page), kept as a hidden field.
    pub group: String,
    pub event_type: String,
    pub error: String,
    pub since: String,
    pub until: String,
}

/// A row of the dead-letter list.
pub struct DeadLetterRow {
    pub href: String,
    pub position: i64,
    pub perspective: String,
    pub event_type: String,
    pub reason: String,
    pub error: String,
    pub attempts: i32,
    pub at: String,
    pub status: String,
}

/// `templates/console/dead_letters.html`.
#[derive(Template)]
#[template(path = "console/dead_letters.html")]
pub struct DeadLettersPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub perspective_options: Vec<Choice>,
    pub reason_options: Vec<Choice>,
    pub status_options: Vec<Choice>,
    pub form: FilterForm,
    /// `limit` as the form passes it on: empty for the default.
    pub limit_param: String,
    pub count: Option<i64>,
    pub timeout: u64,
    pub is_continuation: bool,
    pub after_position: i64,
    pub first_href: String,
    pub rows: Vec<DeadLetterRow>,
    pub next_href: Option<String>,
    /// The bulk actions' previews of this filter: (label, href). Empty when read-only, when
    /// nothing open matches, or when the filter is not on open dead letters.
    pub bulk: Vec<(&'static str, String)>,
    pub bulk_limit: u32,
}

/// The event of the detail page, as read now.
pub struct EventView {
    pub event_type: String,
    pub global_position: i64,
    pub event_id: String,
    pub stream_id: String,
    pub stream_version: i32,
    pub created_at: String,
    pub data: String,
    pub metadata: Option<String>,
}

/// The dead letter of the detail page.
pub struct DeadLetterView {
    pub position: i64,
    pub perspective: String,
    pub reason: String,
    pub error: String,
    pub attempts: i32,
    pub failures: i32,
    pub at: String,
    pub by: String,
    pub status: String,
    pub status_changed_at: String,
}

/// A history record of the detail page.
pub struct HistoryRow {
    pub at: String,
    pub kind: String,
    pub actor: String,
    pub detail: String,
}

/// `templates/console/detail.html`.
#[derive(Template)]
#[template(path = "console/detail.html")]
pub struct DetailPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    /// The action forms: shown when the dead letter is open and the console not read-only.
    pub actions: Option<ActionsView>,
    /// What a replay would change (`?preview=replay`: a dry run, rolled back).
    pub preview: Option<ReplayPreviewView>,
    pub list_href: String,
    pub dl: DeadLetterView,
    pub event: Option<EventView>,
    pub reread_error: String,
    pub earlier: usize,
    pub history: Vec<HistoryRow>,
}

/// The action forms of the detail page.
pub struct ActionsView {
    pub dead_letter_id: String,
    /// The replay warning, as the CLI prints it.
    pub replay_warning: String,
    /// Where the preview button posts (`preview=replay`): this page, with the replay's dry run.
    pub preview_href: String,
    /// Why replay cannot run here (no handler in this configuration), if so.
    pub replay_unavailable: Option<String>,
    /// What a purge does.
    pub purge_note: String,
}

/// A row of a bulk preview's sample.
pub struct BulkRow {
    pub href: String,
    pub position: i64,
    pub perspective: String,
    pub event_type: String,
    pub reason: String,
    pub error: String,
    pub attempts: i32,
    pub at: String,
}

/// `templates/console/bulk.html`.
#[derive(Template)]
#[template(path = "console/bulk.html")]
pub struct BulkPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    /// `replay`, `requeue`, `purge`.
    pub action: &'static str,
    /// `Replay`, `Requeue`, `Purge`.
    pub label: &'static str,
    /// The filter's parameters as given, non-empty only.
    pub filter: Vec<(String, String)>,
    /// Open dead letters matching.
    pub count: i64,
    /// How many this confirmation covers.
    pub acting: usize,
    pub capped: bool,
    pub limit: u32,
    pub first_position: i64,
    pub last_position: i64,
    pub digest: String,
    pub warning: Option<String>,
    pub list_href: String,
    pub sample: Vec<BulkRow>,
    /// Rows covered beyond the sample.
    pub more: usize,
}

/// A row of the error groups page.
pub struct GroupRow {
    pub fingerprint: String,
    pub perspective: String,
    pub event_type: String,
    pub sqlstate: String,
    pub message: String,
    pub count: i64,
    pub first_seen: String,
    pub last_seen: String,
    pub sample_position: i64,
    pub sample_href: String,
    /// The dead-letter list filtered by this group.
    pub list_href: String,
    /// The bulk previews of this group: (label, href); empty when read-only.
    pub bulk: Vec<(&'static str, String)>,
    /// How many of its open dead letters arrived in the window.
    pub recent: i64,
    /// Their arrivals over the window, a rendered inline SVG ([`super::chart::sparkline`]).
    pub sparkline: String,
}

/// `templates/console/groups.html`.
#[derive(Template)]
#[template(path = "console/groups.html")]
pub struct GroupsPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub perspective: String,
    pub total: i64,
    pub groups: Vec<GroupRow>,
    /// "last 24 hours", …
    pub window_label: &'static str,
    pub window_links: Vec<WindowLink>,
}

/// A row of the blocked lanes page.
pub struct BlockedRow {
    pub perspective: String,
    pub stream: String,
    pub head_position: i64,
    pub event_type: String,
    pub attempts: i32,
    pub failures: i32,
    pub next_retry: String,
    pub fingerprint: String,
    /// The dead-letter list of that fingerprint.
    pub group_href: String,
    pub error: String,
    pub waiting: i64,
    pub waiting_since: String,
}

/// `templates/console/blocked.html`.
#[derive(Template)]
#[template(path = "console/blocked.html")]
pub struct BlockedPage {
    pub read_only: bool,
    pub flash: Option<Flash>,
    pub now: String,
    pub perspective: String,
    pub total_lanes: i64,
    pub total_events: i64,
    /// Fewer lanes listed than are blocked.
    pub truncated: bool,
    /// (perspective, lanes, events).
    pub totals: Vec<(String, i64, i64)>,
    pub lanes: Vec<BlockedRow>,
}

/// A row a replay would write, for the detail page's preview.
pub struct PreviewRow {
    pub table: String,
    pub key: String,
    pub before: String,
    pub after: String,
}

/// A replay's dry run, for the detail page.
pub struct ReplayPreviewView {
    pub header: String,
    /// The handler would succeed.
    pub ok: bool,
    pub summary: String,
    pub rows: Vec<PreviewRow>,
    /// What the statement returns, when it returns rows of its own.
    pub returned: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::visible;

    #[test]
    fn disguising_characters_are_shown_escaped_in_text_and_kept_in_attributes() {
        let page = "<title>a\u{202e}b</title><td>Order\u{202e}dekcalP</td>\
                    <input type=\"hidden\" name=\"t\" value=\"x\u{200b}y\"><pre>1\r\n\u{1b}[2J\tz</pre>";
        assert_eq!(
            visible(page.to_owned()),
            "<title>a\\u{202e}b</title>\
             <td>Order<span class=\"esc\" title=\"U+202E\">\\u{202e}</span>dekcalP</td>\
             <input type=\"hidden\" name=\"t\" value=\"x&#x200b;y\">\
             <pre>1<span class=\"esc\" title=\"U+000D\">\\r</span>\n\
             <span class=\"esc\" title=\"U+001B\">\\u{1b}</span>[2J\tz</pre>"
        );
        let plain = "<p>ünïcødé ✓</p>\n".to_owned();
        assert_eq!(visible(plain.clone()), plain);
    }
}
