//! The operator console in a real browser (issue 10): Debian's chromium, headless, driven
//! through chromedriver (`tests/support/browser.rs`), against the console served in-process
//! over a real database. What a person does: open the overview, follow the dead letters, filter,
//! read a detail, replay / requeue / purge, requeue in bulk after the preview, lose a race,
//! and what they must not be able to do: read without credentials, post from another site,
//! change anything in read-only mode. No page may violate the Content-Security-Policy.
//!
//! Each test has a database of its own on the binary's one PostgreSQL server, and a browser of
//! its own. `cargo test --test console -- --ignored screenshots` rewrites the PNGs under
//! docs/.

use std::time::Duration;

use vantage::config::{ConsoleSettings, LoadOptions, Secret, Settings};
use vantage::internals::store::StoreInternals as _;

use crate::support::browser::{with_browser, Browser, Served};
use crate::support::{seeded, Env};

/// Dead letters: order_summary 2 (its total "abc" is not a number), audit 1, audit 4 (an
/// `OrderShipped`, PermanentFailure, an error about an overflow), legacy 2.
async fn with_dead_letters() -> Env {
    let env = seeded().await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("audit", 1, "MaxAttemptsExceeded").await;
    let id = env.dead_letter("audit", 4, "PermanentFailure").await;
    sqlx::query("UPDATE wh_dead_letters SET error_text = 'numeric field Overflow in total' WHERE dead_letter_id = $1")
        .bind(id)
        .execute(env.store.pool())
        .await
        .unwrap();
    env.dead_letter("legacy", 2, "MaxAttemptsExceeded").await;
    env
}

/// The test's configuration with `console` as its `[console]`.
fn settings(env: &Env, console: ConsoleSettings) -> Settings {
    let mut s = Settings::load(&LoadOptions {
        config_path: Some(env.config.clone()),
        ..Default::default()
    })
    .expect("the test configuration loads");
    s.console = console;
    s
}

async fn serve(env: &Env) -> Served {
    Served::start(&env.store, &settings(env, ConsoleSettings::default())).await
}

/// No page so far violated the Content-Security-Policy.
async fn assert_no_csp_violations(b: &Browser) {
    let violations = b.csp_violations().await;
    assert!(violations.is_empty(), "CSP violations: {violations:#?}");
}

#[tokio::test]
async fn overview_list_filter_and_detail() {
    let env = with_dead_letters().await;
    let served = serve(&env).await;
    let base = served.url("");
    with_browser(|b| async move {
        b.goto(&format!("{base}/")).await;
        let text = b.text().await;
        assert!(
            text.contains("Overview") && text.contains("order_summary"),
            "{text}"
        );
        assert!(text.contains("1 live instance(s)."), "{text}");
        // It refreshes itself until paused.
        assert!(b.has("meta[http-equiv=refresh]").await);
        b.click("a[href='/?refresh=off']").await;
        assert_eq!(b.path().await, "/?refresh=off");
        assert!(!b.has("meta[http-equiv=refresh]").await);
        assert!(b.text().await.contains("Auto-refresh paused."));

        // "Dead letters are growing": follow audit's count to its list.
        b.click("a.alert[href='/dead-letters?perspective=audit']")
            .await;
        assert_eq!(b.path().await, "/dead-letters?perspective=audit");
        assert!(b.text().await.contains("2 matching dead letter(s)."));

        // Filter with the form: the filter lands in the URL.
        b.goto(&format!("{base}/dead-letters")).await;
        assert!(b.text().await.contains("4 matching dead letter(s)."));
        let select = b
            .client
            .find(fantoccini::Locator::Css("select[name=perspective]"))
            .await
            .unwrap();
        select.select_by_value("audit").await.unwrap();
        b.client
            .find(fantoccini::Locator::Css("input[name=error]"))
            .await
            .unwrap()
            .send_keys("overflow")
            .await
            .unwrap();
        b.click("form.filters button[type=submit]").await;
        let path = b.path().await;
        assert!(
            path.starts_with("/dead-letters?perspective=audit") && path.contains("error=overflow"),
            "{path}"
        );
        let text = b.text().await;
        assert!(text.contains("1 matching dead letter(s)."), "{text}");

        // Its detail: the event read live, the error, the history.
        b.click("a[href='/dead-letters/4/audit']").await;
        assert_eq!(b.path().await, "/dead-letters/4/audit");
        let text = b.text().await;
        for want in [
            "Event (read live from wh_event_store)",
            "OrderShipped",
            "numeric field Overflow in total",
            "PermanentFailure",
            "Exhausted",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert_no_csp_violations(&b).await;
    })
    .await;
}

#[tokio::test]
async fn replay_requeue_and_purge_from_the_detail_page() {
    let env = with_dead_letters().await;
    let served = serve(&env).await;
    let base = served.url("");
    let env = &env;
    with_browser(|b| async move {
        // Requeue.
        b.goto(&format!("{base}/dead-letters/1/audit")).await;
        assert!(b.text().await.contains("Warning: replay re-runs the handler's side effects out of order"));
        b.click("form.action:has(input[value=requeue]) button").await;
        let text = b.text().await;
        assert!(text.contains("Requeued position 1 of 'audit'."), "{text}");
        assert!(!b.has("form.action").await, "no actions on a requeued dead letter");
        assert_eq!(env.status_of("audit", 1).await, "requeued");

        // Replay: the handler fails again on the bad total.
        b.goto(&format!("{base}/dead-letters/2/order_summary")).await;
        b.click("form.action:has(input[value=replay]) button").await;
        let text = b.text().await;
        assert!(text.contains("Replay of position 2 failed again:"), "{text}");
        assert!(text.contains("ReplayFailed"), "the history shows it: {text}");
        assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
        // Fixed at the source, replayed again: resolved.
        sqlx::query("UPDATE wh_event_store SET event_data = jsonb_set(event_data, '{total}', '\"3\"') WHERE global_position = 2")
            .execute(env.store.pool())
            .await
            .unwrap();
        b.click("form.action:has(input[value=replay]) button").await;
        let text = b.text().await;
        assert!(text.contains("Replayed position 2 through 'order_summary': resolved."), "{text}");
        assert_eq!(env.status_of("order_summary", 2).await, "resolved");

        // Purge.
        b.goto(&format!("{base}/dead-letters/2/legacy")).await;
        b.click("form.action:has(input[value=purge]) button").await;
        assert!(b.text().await.contains("Purged position 2."));
        assert_eq!(env.status_of("legacy", 2).await, "purged");
        assert_no_csp_violations(&b).await;
    })
    .await;
}

#[tokio::test]
async fn a_bulk_requeue_shows_its_preview_first() {
    let env = with_dead_letters().await;
    let served = serve(&env).await;
    let base = served.url("");
    let env = &env;
    with_browser(|b| async move {
        b.goto(&format!("{base}/dead-letters?perspective=audit"))
            .await;
        b.click("a.button[href^='/bulk?action=requeue']").await;
        let text = b.text().await;
        assert!(text.contains("2 open dead letter(s) match now"), "{text}");
        assert!(
            text.contains("This confirmation covers all 2 (positions 1 to 4)."),
            "{text}"
        );
        assert!(
            text.contains("perspective"),
            "the filter is repeated: {text}"
        );
        assert!(
            b.has("a[href='/dead-letters/1/audit']").await
                && b.has("a[href='/dead-letters/4/audit']").await
        );
        assert_eq!(
            env.status_of("audit", 1).await,
            "exhausted",
            "a preview changes nothing"
        );

        b.click("form.confirm button[type=submit]").await;
        let path = b.path().await;
        assert!(
            path.starts_with("/dead-letters?perspective=audit&flash="),
            "{path}"
        );
        let text = b.text().await;
        assert!(
            text.contains("Requeued 2 of 2 dead-lettered event(s)."),
            "{text}"
        );
        assert!(text.contains("0 matching dead letter(s)."), "{text}");
        assert_eq!(env.status_of("audit", 1).await, "requeued");
        assert_eq!(env.status_of("audit", 4).await, "requeued");
        assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
        assert_no_csp_violations(&b).await;
    })
    .await;
}

#[tokio::test]
async fn a_lost_race_says_so_and_does_nothing() {
    let env = with_dead_letters().await;
    let served = serve(&env).await;
    let base = served.url("");
    let env = &env;
    with_browser(|b| async move {
        // Two tabs on one dead letter: the second purges it, the first then tries to requeue.
        let detail = format!("{base}/dead-letters/2/legacy");
        b.goto(&detail).await;
        let first = b.client.window().await.unwrap();
        let second = b.client.new_window(true).await.unwrap();
        b.client.switch_to_window(second.handle).await.unwrap();
        b.goto(&detail).await;
        b.click("form.action:has(input[value=purge]) button").await;
        assert!(b.text().await.contains("Purged position 2."));
        b.client.switch_to_window(first).await.unwrap();
        b.click("form.action:has(input[value=requeue]) button").await;
        let text = b.text().await;
        assert!(
            text.contains("Position 2 is no longer dead-lettered: another command changed it while this one was waiting. Nothing was done."),
            "{text}"
        );
        assert_eq!(env.status_of("legacy", 2).await, "purged");

        // A bulk confirmation after the set changed: refused, the new preview shown.
        b.goto(&format!("{base}/bulk?action=requeue")).await;
        assert!(b.text().await.contains("3 open dead letter(s) match now"));
        let id: uuid::Uuid = sqlx::query_scalar(
            "SELECT dead_letter_id FROM wh_dead_letters WHERE perspective_name = 'audit' AND global_position = 1",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap();
        assert!(env.store.purge_dead_letter(id, "another operator").await.unwrap());
        b.click("form.confirm button[type=submit]").await;
        let text = b.text().await;
        assert!(
            text.contains("The matching dead letters changed since the preview: 3 matched then, 2 match now. Nothing was done"),
            "{text}"
        );
        assert!(text.contains("2 open dead letter(s) match now"), "{text}");
        assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
        assert_eq!(env.status_of("audit", 4).await, "exhausted");
        assert_no_csp_violations(&b).await;
    })
    .await;
}

#[tokio::test]
async fn without_credentials_the_browser_gets_401() {
    let env = with_dead_letters().await;
    let served = Served::start(
        &env.store,
        &settings(
            &env,
            ConsoleSettings {
                auth_token: Some(Secret::new("tok-browser-test")),
                ..ConsoleSettings::default()
            },
        ),
    )
    .await;
    let base = served.url("");
    with_browser(|b| async move {
        for path in ["/", "/dead-letters", "/dead-letters/1/audit"] {
            b.goto(&format!("{base}{path}")).await;
            let text = b.text().await;
            assert!(text.contains("Authentication required"), "{path}: {text}");
            assert!(text.contains("HTTP 401"), "{path}: {text}");
            assert!(!text.contains("tok-browser-test"), "{text}");
            assert!(!text.contains("audit"), "nothing of the data: {text}");
        }
        assert_no_csp_violations(&b).await;
    })
    .await;
}

/// A page of another site with a form that posts a purge to the console.
async fn evil_site(
    console_port: u16,
    dead_letter_id: String,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let page = format!(
        "<!DOCTYPE html><html><body><h1>Win a prize</h1>\
         <form method=\"post\" action=\"http://127.0.0.1:{console_port}/actions\">\
         <input type=\"hidden\" name=\"action\" value=\"purge\">\
         <input type=\"hidden\" name=\"dead_letter_id\" value=\"{dead_letter_id}\">\
         <input type=\"hidden\" name=\"position\" value=\"1\">\
         <input type=\"hidden\" name=\"perspective\" value=\"audit\">\
         <button type=\"submit\">Claim</button></form></body></html>"
    );
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let page = page.clone();
            async move { axum::response::Html(page) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

#[tokio::test]
async fn a_post_from_another_site_is_refused_with_403() {
    let env = with_dead_letters().await;
    let served = serve(&env).await;
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT dead_letter_id FROM wh_dead_letters WHERE perspective_name = 'audit' AND global_position = 1",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    let (evil, task) = evil_site(served.addr.port(), id.to_string()).await;
    let env = &env;
    with_browser(|b| async move {
        // Another site: "localhost" is not the console's 127.0.0.1.
        b.goto(&format!("http://localhost:{}/", evil.port())).await;
        b.click("button[type=submit]").await;
        let text = b.text().await;
        assert!(text.contains("Cross-site request refused"), "{text}");
        assert!(text.contains("HTTP 403"), "{text}");
        assert_eq!(env.status_of("audit", 1).await, "exhausted", "nothing done");
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn read_only_mode_shows_no_button_and_refuses_actions() {
    let env = with_dead_letters().await;
    let served = Served::start(
        &env.store,
        &settings(
            &env,
            ConsoleSettings {
                read_only: true,
                ..ConsoleSettings::default()
            },
        ),
    )
    .await;
    let base = served.url("");
    let env = &env;
    with_browser(|b| async move {
        b.goto(&format!("{base}/dead-letters/1/audit")).await;
        assert!(b.text().await.contains("read-only"));
        assert!(!b.has("button").await, "no button on the detail page");
        assert!(!b.has("form[method=post]").await);
        b.goto(&format!("{base}/dead-letters")).await;
        assert!(!b.has("a.button").await, "no bulk action on the list");
        b.goto(&format!("{base}/bulk?action=requeue")).await;
        let text = b.text().await;
        assert!(text.contains("This console is read-only"), "{text}");
        assert!(text.contains("HTTP 403"), "{text}");
        assert_eq!(env.status_of("audit", 1).await, "exhausted");
        assert_no_csp_violations(&b).await;
    })
    .await;
}

/// The CSP check sees violations: an image from a `data:` URL (nothing leaves the machine),
/// which `img-src 'self'` forbids, is reported.
#[tokio::test]
async fn the_csp_check_would_see_a_violation() {
    let env = Env::new().await;
    let served = serve(&env).await;
    let base = served.url("");
    with_browser(|b| async move {
        b.goto(&format!("{base}/")).await;
        assert_no_csp_violations(&b).await;
        b.client
            .execute(
                "const i = document.createElement('img'); \
                 i.src = 'data:image/gif;base64,R0lGODlhAQABAAAAACw='; \
                 document.body.appendChild(i);",
                vec![],
            )
            .await
            .unwrap();
        let mut seen = Vec::new();
        for _ in 0..50 {
            seen.extend(b.csp_violations().await);
            if !seen.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            seen.iter().any(|m| m.contains("img-src")),
            "the violation is in the browser log: {seen:#?}"
        );
    })
    .await;
}

/// order_summary's stream B lane is blocked: its head (3) keeps failing, 4 waits behind it.
async fn block_a_lane(env: &Env) {
    sqlx::query(
        "UPDATE wh_perspective_events SET failures = 2, attempts = 2, \
             last_error = 'invalid input syntax for type uuid: \"ord-3\" (SQLSTATE 22P02)', \
             scheduled_for = now() + interval '1 hour' \
         WHERE perspective_name = 'order_summary' AND global_position = 3",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
}

/// Triage (issue 11): from the overview's blocked lanes to the groups, a group's list, the
/// replay preview of its sample, and the group requeued through the bulk preview.
#[tokio::test]
async fn triage_groups_blocked_lanes_and_the_replay_preview() {
    let env = with_dead_letters().await;
    block_a_lane(&env).await;
    let served = serve(&env).await;
    let base = served.url("");
    let env = &env;
    with_browser(|b| async move {
        b.goto(&format!("{base}/?refresh=off")).await;
        b.click("a.alert[href='/blocked?perspective=order_summary']")
            .await;
        let text = b.text().await;
        assert!(
            text.contains("1 blocked lane(s) holding 1 event(s)"),
            "{text}"
        );

        b.click("nav a[href='/groups']").await;
        let text = b.text().await;
        // audit 1 and legacy 2 and order_summary 2 share the helper's error text, but not their
        // perspective; audit 4 has its own.
        assert!(
            text.contains("4 open dead letter(s) in 4 group(s)."),
            "{text}"
        );
        assert!(text.contains("numeric field Overflow in total"), "{text}");

        // The audit group of position 1: its list, then the sample's replay preview.
        let fp: String = sqlx::query_scalar(
            "SELECT error_fingerprint FROM wh_dead_letters \
             WHERE perspective_name = 'audit' AND global_position = 1",
        )
        .fetch_one(env.store.pool())
        .await
        .unwrap();
        b.click(&format!("a[href='/dead-letters?group={fp}']"))
            .await;
        assert!(b.text().await.contains("1 matching dead letter(s)."));
        b.click("a[href='/dead-letters/1/audit']").await;
        // The preview is a POST (it runs the statement, rolled back): a button, not a link.
        b.click("button[name=preview][value=replay]").await;
        let text = b.text().await;
        assert!(text.contains("What a replay would change"), "{text}");
        assert!(
            text.contains("The handler succeeds: a replay would resolve position 1."),
            "{text}"
        );
        assert!(text.contains("public.audit_log"), "{text}");
        assert_eq!(env.status_of("audit", 1).await, "exhausted");

        // Requeue the group from the groups page, through the preview.
        b.goto(&format!("{base}/groups?perspective=audit")).await;
        b.click(&format!("a.button[href='/bulk?action=requeue&group={fp}']"))
            .await;
        let text = b.text().await;
        assert!(text.contains("1 open dead letter(s) match now"), "{text}");
        b.click("form.confirm button[type=submit]").await;
        assert!(b
            .text()
            .await
            .contains("Requeued 1 of 1 dead-lettered event(s)."));
        assert_eq!(env.status_of("audit", 1).await, "requeued");
        assert_eq!(env.status_of("audit", 4).await, "exhausted");
        assert_no_csp_violations(&b).await;
    })
    .await;
}

/// Issue 23, item 3: the charts (inline SVG) render on the overview, a perspective's page and
/// the groups, the window links switch them, and nothing violates the CSP (no inline style,
/// nothing loaded).
#[tokio::test]
async fn charts_render_within_the_content_security_policy() {
    let env = with_dead_letters().await;
    sample_history(&env).await;
    let served = serve(&env).await;
    let base = served.url("");
    with_browser(|b| async move {
        b.goto(&format!("{base}/")).await;
        assert!(b.has("figure.chart svg.chart path.chart-line").await);
        assert!(b.has("meta[http-equiv=refresh]").await);
        b.click("a.window[href='/?window=6h']").await;
        assert_eq!(b.path().await, "/?window=6h");
        assert!(b.text().await.contains("History, last 6 hours"));
        // The auto-refresh reloads this URL: the window stays.
        assert!(b.has("meta[http-equiv=refresh]").await);
        b.click("a[href='/perspectives/order_summary']").await;
        assert_eq!(b.path().await, "/perspectives/order_summary");
        assert!(b.has("svg.chart path.chart-line").await);
        assert!(b.text().await.contains("Applied events per second"));
        b.goto(&format!("{base}/groups")).await;
        assert!(b.has("td.arrivals svg.sparkline rect.chart-bar").await);
        assert_no_csp_violations(&b).await;
    })
    .await;
}

/// Ten minutes of chart history for order_summary, ending two minutes ago.
async fn sample_history(env: &Env) {
    sqlx::query(
        "INSERT INTO wh_metric_samples (minute, perspective_name, applied, backlog, lag_seconds) \
         SELECT date_trunc('minute', now()) - make_interval(mins => m), 'order_summary', \
                600 + 60 * (m % 4), 40 - 3 * m, 20 + m \
         FROM generate_series(2, 11) AS m",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
}

/// Writes docs/console-*.png: every page at the harness's window size, the replay preview as
/// an operator reaches it (its button on the detail page).
#[tokio::test]
#[ignore = "run by hand to refresh the README's screenshots"]
async fn screenshots() {
    let env = with_dead_letters().await;
    block_a_lane(&env).await;
    sample_history(&env).await;
    let served = serve(&env).await;
    let base = served.url("");
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    with_browser(|b| async move {
        for (path, file) in [
            ("/?refresh=off", "console-overview.png"),
            ("/dead-letters", "console-dead-letters.png"),
            ("/dead-letters/2/order_summary", "console-detail.png"),
            (
                "/bulk?action=requeue&perspective=audit",
                "console-bulk-preview.png",
            ),
            ("/groups", "console-groups.png"),
            ("/perspectives/order_summary", "console-perspective.png"),
            ("/blocked", "console-blocked.png"),
        ] {
            b.goto(&format!("{base}{path}")).await;
            b.screenshot(&docs.join(file)).await;
        }
        // The replay preview is an action (a same-origin POST that runs the statement, rolled
        // back), not a GET: the detail page's button.
        b.goto(&format!("{base}/dead-letters/2/order_summary"))
            .await;
        b.click("button[name=preview][value=replay]").await;
        let text = b.text().await;
        assert!(text.contains("What a replay would change"), "{text}");
        b.screenshot(&docs.join("console-replay-preview.png")).await;
        assert_no_csp_violations(&b).await;
    })
    .await;
}

/// Item 17: an event type with a right-to-left override (and an error text with zero-width
/// characters) reads as what it is, escaped and marked, not as another name.
#[tokio::test]
async fn bidi_and_zero_width_characters_show_escaped_in_the_browser() {
    let env = seeded().await;
    let appended = env
        .append(
            uuid::Uuid::new_v4(),
            &[(
                "Order\u{202e}dekcalP",
                serde_json::json!({"note": "a\u{200b}b"}),
            )],
        )
        .await;
    let n = appended[0].global_position;
    env.dead_letter_with_error(
        "audit",
        n,
        "MaxAttemptsExceeded",
        "bad \u{2066}value\u{2069}",
    )
    .await;
    let served = serve(&env).await;
    let base = served.url("");
    with_browser(|b| async move {
        b.goto(&format!("{base}/dead-letters?perspective=audit"))
            .await;
        let text = b.text().await;
        assert!(text.contains("Order\\u{202e}dekcalP"), "{text}");
        assert!(!text.contains('\u{202e}'), "{text}");
        assert!(b.has("td span.esc[title='U+202E']").await);
        b.click(&format!("a[href='/dead-letters/{n}/audit']")).await;
        let text = b.text().await;
        for shown in [
            "Order\\u{202e}dekcalP",
            "bad \\u{2066}value\\u{2069}",
            "a\\u{200b}b",
        ] {
            assert!(text.contains(shown), "{shown}: {text}");
        }
        assert!(
            !text
                .chars()
                .any(|c| matches!(c, '\u{200b}' | '\u{202e}' | '\u{2066}' | '\u{2069}')),
            "{text}"
        );
        assert_no_csp_violations(&b).await;
    })
    .await;
}
