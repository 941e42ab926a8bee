//! HTTP-level tests of the operator console (docs/cli.md, "The console"), against real PostgreSQL:
//! every route through the real router in-process (`tower::ServiceExt::oneshot`), one over a real
//! socket, and the configuration rules through `vantage config check` and `cli::console::run`.
//!
//! Dead letters are made the way the daemon makes them (`support::Env::dead_letter`).

use axum::body::Body;
use axum::http::{header, Request, Response, StatusCode};
use axum::Router;
use base64::Engine as _;
use tower::ServiceExt as _;
use vantage::config::{ConsoleSettings, Secret, Settings};
use vantage::internals::console::{self, security, ConsoleState};
use vantage::internals::store::StoreInternals as _;

use serde_json::json;

use crate::support;
use crate::support::{base_command, finish, seeded, Env, STREAM_A, STREAM_B};

/// The test's configuration file (its perspectives are the handlers a replay runs) with
/// `console` as the `[console]` section.
fn settings_with(env: &Env, console: &ConsoleSettings) -> Settings {
    let mut settings = Settings::load(&vantage::config::LoadOptions {
        config_path: Some(env.config.clone()),
        ..Default::default()
    })
    .expect("the test configuration loads");
    settings.console = console.clone();
    settings
}

/// The console over the test's database with `settings`.
fn console_with(env: &Env, settings: &ConsoleSettings) -> Router {
    let store = env.store.with_statement_timeout(console::STATEMENT_TIMEOUT);
    console::router(ConsoleState::new(store, &settings_with(env, settings)))
}

fn open_console(env: &Env) -> Router {
    console_with(env, &ConsoleSettings::default())
}

/// Whether a page shows the seeded poison total `"abc"` (as JSON, HTML-escaped or not). A bare
/// `abc` is no evidence: random UUIDs on the page contain it.
fn shows_poison_total(body: &str) -> bool {
    [
        "\"abc\"",
        "&quot;abc&quot;",
        "&#34;abc&#34;",
        "&#x22;abc&#x22;",
    ]
    .iter()
    .any(|form| body.contains(form))
}

async fn send(router: &Router, request: Request<Body>) -> (Response<Body>, String) {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    (Response::from_parts(parts, Body::empty()), text)
}

async fn get(router: &Router, uri: &str) -> (Response<Body>, String) {
    send(router, Request::get(uri).body(Body::empty()).unwrap()).await
}

/// The `Location` of a 303.
#[track_caller]
fn location(response: &Response<Body>) -> String {
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    response.headers()[header::LOCATION]
        .to_str()
        .unwrap()
        .to_owned()
}

/// GET the `Location` of a 303, as a browser follows it.
async fn follow(router: &Router, response: &Response<Body>) -> (Response<Body>, String) {
    get(router, &location(response)).await
}

/// GET that must answer 200; returns the body.
#[track_caller]
fn ok(response: (Response<Body>, String)) -> String {
    assert_eq!(response.0.status(), StatusCode::OK, "{}", response.1);
    response.1
}

/// The security headers (docs/cli.md, "The console"), and no CORS.
#[track_caller]
fn assert_secure(response: &Response<Body>, what: &str) {
    for (name, value) in security::SECURITY_HEADERS {
        assert_eq!(
            response.headers().get(*name).and_then(|v| v.to_str().ok()),
            Some(*value),
            "{what}: header {name}"
        );
    }
    let csp = response.headers()[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    assert!(
        csp.contains("style-src 'self'") && !csp.contains("script-src"),
        "{csp}"
    );
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    for (name, _) in response.headers() {
        assert!(
            !name.as_str().starts_with("access-control-"),
            "{what}: CORS header {name}"
        );
    }
}

/// The one `href` of the `rel="next"` link, unescaped.
fn next_link(body: &str) -> Option<String> {
    let start = body.find("rel=\"next\" href=\"")? + "rel=\"next\" href=\"".len();
    let end = start + body[start..].find('"')?;
    Some(
        body[start..end]
            .replace("&amp;", "&")
            .replace("&#x3D;", "="),
    )
}

/// Positions of the list's rows, in order.
fn positions(body: &str, perspective: &str) -> Vec<i64> {
    let needle = "href=\"/dead-letters/";
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find(needle) {
        rest = &rest[i + needle.len()..];
        let end = rest.find('"').unwrap();
        let (position, name) = rest[..end].split_once('/').unwrap();
        if perspective.is_empty() || name == perspective {
            out.push(position.parse().unwrap());
        }
    }
    out
}

/// Dead letters: order_summary 2 (the poison total), audit 1, audit 4 (an `OrderShipped`,
/// PermanentFailure, error text about an overflow), legacy 2.
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

#[tokio::test]
async fn overview_shows_each_perspective_its_dead_letters_and_the_instances() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    let body = ok(get(&console, "/").await);
    for name in ["order_summary", "audit", "legacy"] {
        // Each name links to its own page.
        assert!(
            body.contains(&format!(
                "<td><a href=\"/perspectives/{name}\">{name}</a></td>"
            )),
            "{body}"
        );
    }
    // audit has 2 open dead letters, linked to its filtered list.
    assert!(
        body.contains("<a class=\"alert\" href=\"/dead-letters?perspective=audit\">2</a>"),
        "{body}"
    );
    assert!(body.contains(&env.instance.to_string()), "{body}");
    assert!(body.contains("1 live instance(s)."), "{body}");
    assert!(
        body.contains("<meta http-equiv=\"refresh\" content=\"10\">"),
        "{body}"
    );
    assert!(!body.contains("<script"), "{body}");

    let paused = ok(get(&console, "/?refresh=off").await);
    assert!(!paused.contains("http-equiv=\"refresh\""), "{paused}");
    assert!(paused.contains("Auto-refresh paused."), "{paused}");
}

#[tokio::test]
async fn dead_letter_list_filters_counts_and_links_to_details() {
    let env = with_dead_letters().await;
    let console = open_console(&env);

    let all = ok(get(&console, "/dead-letters").await);
    assert!(all.contains("4 matching dead letter(s)."), "{all}");
    assert!(
        !all.contains("name=\"limit\""),
        "the default page size is not repeated: {all}"
    );
    assert_eq!(positions(&all, "audit"), vec![4, 1]);
    assert!(
        all.contains("href=\"/dead-letters/2/order_summary\""),
        "{all}"
    );
    assert!(all.contains("href=\"/dead-letters/2/legacy\""), "{all}");
    // List rows carry no payload: the poison total is in the event data only.
    assert!(!shows_poison_total(&all), "{all}");

    let cases: &[(&str, usize, &[i64])] = &[
        ("/dead-letters?perspective=audit", 2, &[4, 1]),
        ("/dead-letters?reason=PermanentFailure", 1, &[4]),
        ("/dead-letters?event_type=OrderShipped", 1, &[4]),
        ("/dead-letters?error=overflow", 1, &[4]),
        (
            "/dead-letters?perspective=audit&reason=MaxAttemptsExceeded",
            1,
            &[1],
        ),
        (
            "/dead-letters?since=2000-01-01&until=2999-01-01T00:00",
            4,
            &[4, 2, 2, 1],
        ),
        ("/dead-letters?since=2999-01-01", 0, &[]),
        ("/dead-letters?status=purged", 0, &[]),
        ("/dead-letters?status=any&perspective=legacy", 1, &[2]),
    ];
    for (uri, count, expected) in cases {
        let body = ok(get(&console, uri).await);
        assert!(
            body.contains(&format!("{count} matching dead letter(s).")),
            "{uri}: {body}"
        );
        assert_eq!(positions(&body, ""), *expected, "{uri}");
    }
    // The form shows the filter it was given.
    let body = ok(get(&console, "/dead-letters?perspective=audit&error=overflow").await);
    assert!(body.contains("<option value=\"audit\" selected>"), "{body}");
    assert!(body.contains("name=\"error\" value=\"overflow\""), "{body}");

    for (uri, parameter) in [
        ("/dead-letters?since=yesterday", "since"),
        ("/dead-letters?status=open", "status"),
        ("/dead-letters?limit=0", "limit"),
        ("/dead-letters?after=nonsense", "after"),
    ] {
        let (response, body) = get(&console, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert!(body.contains(&format!("{parameter} = ")), "{uri}: {body}");
        assert_secure(&response, uri);
    }
}

#[tokio::test]
async fn dead_letter_pages_are_walked_by_keyset_keeping_the_filter() {
    let env = with_dead_letters().await;
    let console = open_console(&env);

    let mut uri = "/dead-letters?limit=2".to_owned();
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let body = ok(get(&console, &uri).await);
        pages += 1;
        assert!(body.contains("4 matching dead letter(s)."), "{body}");
        // The filter form keeps the page size.
        assert!(body.contains("name=\"limit\" value=\"2\""), "{body}");
        seen.extend(positions(&body, ""));
        match next_link(&body) {
            Some(next) => {
                assert!(
                    next.contains("limit=2") && next.contains("after="),
                    "{next}"
                );
                uri = next;
            }
            None => break,
        }
        assert!(pages < 5, "pagination does not end");
    }
    assert_eq!(pages, 2);
    assert_eq!(seen, vec![4, 2, 2, 1]);

    // A filter is kept across pages.
    let body = ok(get(&console, "/dead-letters?perspective=audit&limit=1").await);
    assert_eq!(positions(&body, ""), vec![4]);
    let next = next_link(&body).expect("a second page");
    assert!(next.contains("perspective=audit"), "{next}");
    let body = ok(get(&console, &next).await);
    assert_eq!(positions(&body, ""), vec![1]);
    assert!(next_link(&body).is_none(), "{body}");
    assert!(body.contains("First page"), "{body}");
}

#[tokio::test]
async fn detail_rereads_the_event_live_and_shows_the_whole_dead_letter() {
    let env = with_dead_letters().await;
    let console = open_console(&env);

    let body = ok(get(&console, "/dead-letters/2/order_summary").await);
    assert!(
        body.contains("Dead-lettered position 2 in perspective &#x27;order_summary&#x27;")
            || body.contains("Dead-lettered position 2 in perspective 'order_summary'"),
        "{body}"
    );
    assert!(
        body.contains("Event (read live from wh_event_store)"),
        "{body}"
    );
    assert!(body.contains("OrderPlaced"), "{body}");
    assert!(shows_poison_total(&body), "the event data: {body}");
    assert!(body.contains("MaxAttemptsExceeded"), "{body}");
    assert!(
        body.contains("handler failed: boom"),
        "the error text: {body}"
    );
    assert!(body.contains("<dt>Attempts</dt><dd>11</dd>"), "{body}");
    assert!(body.contains("<dt>Failures</dt><dd>10</dd>"), "{body}");
    assert!(
        body.contains(&format!("instance {}", env.instance)),
        "{body}"
    );
    assert!(body.contains("<td>Exhausted</td>"), "the history: {body}");

    // Live: what the store holds now, not a copy.
    sqlx::query(
        "UPDATE wh_event_store SET event_data = '{\"order_id\": \"x\", \"total\": \"changed-now\"}' \
         WHERE global_position = 2",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    let body = ok(get(&console, "/dead-letters/2/order_summary").await);
    assert!(
        body.contains("changed-now") && !shows_poison_total(&body),
        "{body}"
    );

    // An event that can no longer be read: the dead letter is still shown.
    sqlx::query("UPDATE wh_event_store SET event_id = gen_random_uuid() WHERE global_position = 2")
        .execute(env.store.pool())
        .await
        .unwrap();
    let body = ok(get(&console, "/dead-letters/2/order_summary").await);
    assert!(
        body.contains("Could not re-read the event at position 2."),
        "{body}"
    );
    assert!(body.contains("MaxAttemptsExceeded"), "{body}");

    let (response, body) = get(&console, "/dead-letters/3/order_summary").await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert!(
        body.contains("No dead-lettered event at position 3 in perspective"),
        "{body}"
    );
    let (response, _) = get(&console, "/dead-letters/two/order_summary").await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_secure(&response, "a bad position");
}

#[tokio::test]
async fn every_response_carries_the_security_headers_and_no_cors() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    for uri in [
        "/",
        "/?refresh=off",
        "/dead-letters",
        "/dead-letters?perspective=audit",
        "/dead-letters/2/order_summary",
        "/dead-letters/9/order_summary",
        "/console.css",
        "/no-such-page",
    ] {
        let request = Request::get(uri)
            .header(header::ORIGIN, "http://evil.example")
            .body(Body::empty())
            .unwrap();
        let (response, _) = send(&console, request).await;
        assert_secure(&response, uri);
    }
    let (css, body) = get(&console, "/console.css").await;
    assert_eq!(
        css.headers()[header::CONTENT_TYPE],
        "text/css; charset=utf-8"
    );
    assert!(body.contains("font"), "{body}");
    let (page, _) = get(&console, "/").await;
    assert_eq!(page.headers()[header::CACHE_CONTROL], "no-store");
    assert_eq!(
        page.headers()[header::CONTENT_TYPE],
        "text/html; charset=utf-8"
    );
    // A preflight gets no CORS answer either.
    let preflight = Request::builder()
        .method("OPTIONS")
        .uri("/actions")
        .header(header::ORIGIN, "http://evil.example")
        .header("access-control-request-method", "POST")
        .body(Body::empty())
        .unwrap();
    let (response, _) = send(&console, preflight).await;
    assert_secure(&response, "a CORS preflight");
}

/// A form POST to `uri` from the console's own page (as a browser sends it).
fn form_post(uri: &str, fields: &[(&str, &str)], headers: &[(&str, &str)]) -> Request<Body> {
    let body = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(fields)
        .finish();
    let mut request = Request::post(uri)
        .header(header::HOST, "127.0.0.1:9465")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body)).unwrap()
}

/// A POST of the purge of dead letter `id` (audit, position 1) with these headers.
fn post_with(id: &str, headers: &[(&str, &str)]) -> Request<Body> {
    form_post(
        "/actions",
        &[
            ("action", "purge"),
            ("dead_letter_id", id),
            ("position", "1"),
            ("perspective", "audit"),
        ],
        headers,
    )
}

fn post(headers: &[(&str, &str)]) -> Request<Body> {
    post_with(&uuid::Uuid::nil().to_string(), headers)
}

#[tokio::test]
async fn a_cross_site_post_is_refused_with_403() {
    let env = seeded().await;
    let id = env
        .dead_letter("audit", 1, "MaxAttemptsExceeded")
        .await
        .to_string();
    let console = open_console(&env);
    for headers in [
        &[("sec-fetch-site", "cross-site")][..],
        &[("sec-fetch-site", "same-site")][..],
        &[("origin", "http://evil.example")][..],
        &[("origin", "null")][..],
    ] {
        let (response, body) = send(&console, post_with(&id, headers)).await;
        assert_eq!(
            response.status(),
            StatusCode::FORBIDDEN,
            "{headers:?}: {body}"
        );
        assert!(body.contains("Cross-site request refused"), "{body}");
        assert_secure(&response, "a refused POST");
        assert_eq!(env.status_of("audit", 1).await, "exhausted", "nothing done");
    }
    // Same origin passes the check and reaches the action (here on a dead letter that does
    // not exist, which it says on the page it redirects to).
    for headers in [
        &[("sec-fetch-site", "same-origin")][..],
        &[("origin", "http://127.0.0.1:9465")][..],
        &[][..],
    ] {
        let (response, body) = send(&console, post(headers)).await;
        assert_eq!(
            response.status(),
            StatusCode::SEE_OTHER,
            "{headers:?}: {body}"
        );
        let body = ok(follow(&console, &response).await);
        assert!(
            body.contains("No dead-lettered event at position 1."),
            "{body}"
        );
    }
    assert_eq!(env.status_of("audit", 1).await, "exhausted");
    // Read-only: refused whatever the origin.
    let read_only = console_with(
        &env,
        &ConsoleSettings {
            read_only: true,
            ..ConsoleSettings::default()
        },
    );
    let (response, body) = send(
        &read_only,
        post_with(&id, &[("sec-fetch-site", "same-origin")]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert!(body.contains("read-only"), "{body}");
    assert_eq!(env.status_of("audit", 1).await, "exhausted");
    assert!(ok(get(&read_only, "/").await).contains("<span class=\"badge\">read-only</span>"));
}

#[tokio::test]
async fn an_open_console_answers_only_to_loopback_host_names() {
    let env = Env::new().await;
    let console = open_console(&env);
    let with_host = |host: &str| {
        Request::get("/")
            .header(header::HOST, host)
            .body(Body::empty())
            .unwrap()
    };
    for host in ["127.0.0.1:9465", "localhost:9465", "[::1]:9465"] {
        let (response, body) = send(&console, with_host(host)).await;
        assert_eq!(response.status(), StatusCode::OK, "{host}: {body}");
    }
    // A name rebound to 127.0.0.1 by its owner's DNS (DNS rebinding).
    let (response, body) = send(&console, with_host("rebound.evil.example:9465")).await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("Unknown host name"), "{body}");
    assert_secure(&response, "a foreign host");
    // With credentials, any name may be used (the console may sit behind a proxy).
    let guarded = console_with(
        &env,
        &ConsoleSettings {
            auth_token: Some(Secret::new("tok")),
            ..ConsoleSettings::default()
        },
    );
    let mut request = with_host("console.example.org");
    request
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer tok".parse().unwrap());
    let (response, _) = send(&guarded, request).await;
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn credentials_are_required_when_configured() {
    let env = with_dead_letters().await;
    const TOKEN: &str = "tok-3f9a-not-for-pages";
    const PASSWORD: &str = "pw-77c1-not-for-pages";
    let token_only = console_with(
        &env,
        &ConsoleSettings {
            auth_token: Some(Secret::new(TOKEN)),
            ..ConsoleSettings::default()
        },
    );
    let basic = base64::engine::general_purpose::STANDARD;
    let both = console_with(
        &env,
        &ConsoleSettings {
            auth_token: Some(Secret::new(TOKEN)),
            basic_user: Some("ops".into()),
            basic_password: Some(Secret::new(PASSWORD)),
            ..ConsoleSettings::default()
        },
    );
    for uri in [
        "/",
        "/dead-letters",
        "/dead-letters/2/order_summary",
        "/console.css",
        "/nope",
    ] {
        for (console, challenges) in [
            (&token_only, vec!["Bearer realm=\"vantage console\""]),
            (
                &both,
                vec![
                    "Basic realm=\"vantage console\", charset=\"UTF-8\"",
                    "Bearer realm=\"vantage console\"",
                ],
            ),
        ] {
            for authorization in [
                None,
                Some("Bearer wrong".to_owned()),
                Some(format!("Bearer {TOKEN}x")),
                Some(format!(
                    "Basic {}",
                    basic.encode(format!("ops:{PASSWORD}x"))
                )),
            ] {
                let mut request = Request::get(uri);
                if let Some(a) = &authorization {
                    request = request.header(header::AUTHORIZATION, a);
                }
                let (response, body) = send(console, request.body(Body::empty()).unwrap()).await;
                assert_eq!(
                    response.status(),
                    StatusCode::UNAUTHORIZED,
                    "{uri} {authorization:?}"
                );
                let got: Vec<&str> = response
                    .headers()
                    .get_all(header::WWW_AUTHENTICATE)
                    .iter()
                    .map(|v| v.to_str().unwrap())
                    .collect();
                assert_eq!(got, challenges, "{uri}");
                assert!(!body.contains(TOKEN) && !body.contains(PASSWORD), "{body}");
                assert_secure(&response, "a 401");
            }
        }
    }
    let with = |a: String| {
        Request::get("/dead-letters")
            .header(header::AUTHORIZATION, a)
            .body(Body::empty())
            .unwrap()
    };
    let (response, body) = send(&token_only, with(format!("Bearer {TOKEN}"))).await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
    assert!(body.contains("4 matching dead letter(s)."), "{body}");
    let (response, _) = send(
        &both,
        with(format!("Basic {}", basic.encode(format!("ops:{PASSWORD}")))),
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    // Basic credentials do not open a token-only console.
    let (response, _) = send(
        &token_only,
        with(format!("Basic {}", basic.encode(format!("ops:{TOKEN}")))),
    )
    .await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    // CSRF is checked before credentials: a cross-site POST is 403 even with none.
    let (response, _) = send(&token_only, post(&[("sec-fetch-site", "cross-site")])).await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn console_queries_run_with_a_statement_timeout() {
    let env = Env::new().await;
    let store = env.store.with_statement_timeout(console::STATEMENT_TIMEOUT);
    let setting: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(setting, "5s");
    // And a statement beyond it is cancelled, which a page reports as a 503, not a hang.
    let short = env
        .store
        .with_statement_timeout(std::time::Duration::from_millis(50));
    let err = sqlx::query("SELECT pg_sleep(5)")
        .execute(short.pool())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("statement timeout"), "{err}");
}

#[tokio::test]
async fn serves_over_a_socket_until_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = Env::new().await;
    let store = env.store.with_statement_timeout(console::STATEMENT_TIMEOUT);
    let (listener, local) = console::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    assert!(local.ip().is_loopback() && local.port() != 0);
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(console::serve(
        listener,
        ConsoleState::new(store, &settings_with(&env, &ConsoleSettings::default())),
        stop.clone(),
    ));
    let mut stream = tokio::net::TcpStream::connect(local).await.unwrap();
    stream
        .write_all(
            format!("GET / HTTP/1.1\r\nHost: {local}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stream.read_to_string(&mut answer),
    )
    .await
    .expect("an answer")
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(
        answer.contains("content-security-policy: default-src 'none'"),
        "{answer}"
    );
    assert!(
        answer.contains("No perspectives are registered.")
            || answer.contains("<a href=\"/perspectives/audit\">audit</a>"),
        "{answer}"
    );
    stop.cancel();
    tokio::time::timeout(std::time::Duration::from_secs(30), server)
        .await
        .expect("the server stops when told")
        .unwrap()
        .unwrap();
}

/// The console's listener has the probes' limits: a connection that sends no request head is
/// closed after the request-head timeout, so half-sent requests cannot pile up.
#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_head_timeout() {
    use tokio::io::AsyncReadExt;
    let env = Env::new().await;
    let store = env.store.with_statement_timeout(console::STATEMENT_TIMEOUT);
    let (listener, local) = console::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(console::serve(
        listener,
        ConsoleState::new(store, &settings_with(&env, &ConsoleSettings::default())),
        stop.clone(),
    ));
    let mut silent = tokio::net::TcpStream::connect(local).await.unwrap();
    let limit = vantage::internals::telemetry::http::REQUEST_HEAD_TIMEOUT
        + std::time::Duration::from_secs(5);
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(limit, silent.read(&mut buf))
        .await
        .expect("closed by the server within the request-head timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    stop.cancel();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(30), server).await;
}

// ---------------------------------------------------------------------------------------------
// Configuration: the [console] keys, the loopback rule, the secrets

#[tokio::test]
async fn a_non_loopback_listen_without_authentication_is_refused_with_78() {
    let env = Env::new().await;
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env("VANTAGE__CONSOLE__LISTEN", "0.0.0.0:9465");
    let run = finish(check).await;
    assert_eq!(run.code, 78, "{run:?}");
    assert!(
        run.stderr.contains("console.listen = \"0.0.0.0:9465\" (from VANTAGE__CONSOLE__LISTEN): expected a loopback address"),
        "{run:?}"
    );

    // The same from `vantage console` itself, before it connects or binds anything.
    let global = vantage::cli::GlobalArgs {
        config: Some(env.config.clone()),
        database_url: None,
    };
    let code = vantage::internals::cli::console::run(
        &global,
        vantage::internals::cli::console::ConsoleArgs {
            listen: Some("0.0.0.0:0".into()),
        },
    )
    .await;
    assert_eq!(code, 78);

    // An address that cannot be bound is 78 too, before the database is touched.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let code = vantage::internals::cli::console::run(
        &global,
        vantage::internals::cli::console::ConsoleArgs {
            listen: Some(taken.local_addr().unwrap().to_string()),
        },
    )
    .await;
    assert_eq!(code, 78);

    // With credentials it is accepted, from the file or the environment.
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env("VANTAGE__CONSOLE__LISTEN", "[::]:9465")
        .env("VANTAGE__CONSOLE__AUTH_TOKEN", "tok-1234");
    let run = finish(check).await;
    assert_eq!(run.code, 0, "{run:?}");

    // Basic credentials come in pairs.
    let err = Settings::from_toml_str("[console]\nbasic_user = \"ops\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("console.basic_password: missing"), "{err}");
    let err =
        Settings::from_toml_str("[console]\nlisten = \"10.0.0.1:9465\"\nbasic_password = \"x\"")
            .unwrap_err()
            .to_string();
    assert!(err.contains("console.basic_user: missing"), "{err}");
}

#[tokio::test]
async fn config_check_shows_the_console_keys_with_secrets_redacted() {
    let env = Env::new().await;
    const TOKEN: &str = "tok-b71e-secret";
    const PASSWORD: &str = "pw-91d0-secret";
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env("VANTAGE__CONSOLE__AUTH_TOKEN", TOKEN)
        .env("VANTAGE__CONSOLE__BASIC_USER", "ops")
        .env("VANTAGE__CONSOLE__BASIC_PASSWORD", PASSWORD)
        .env("VANTAGE__CONSOLE__READ_ONLY", "true");
    let run = finish(check).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        !run.stdout.contains(TOKEN) && !run.stdout.contains(PASSWORD),
        "{run:?}"
    );
    assert!(
        !run.stderr.contains(TOKEN) && !run.stderr.contains(PASSWORD),
        "{run:?}"
    );
    let console_section = run
        .stdout
        .split("[console]\n")
        .nth(1)
        .expect("a [console] section")
        .split("\n\n")
        .next()
        .unwrap();
    assert_eq!(
        console_section,
        "listen = \"127.0.0.1:9465\"\nread_only = true\nauth_token = \"***\"\nbasic_user = \"ops\"\nbasic_password = \"***\"",
        "{run:?}"
    );

    // A bad secret is refused without being quoted.
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env(
            "VANTAGE__CONSOLE__AUTH_TOKEN",
            "has a space tok-b71e-secret",
        );
    let run = finish(check).await;
    assert_eq!(run.code, 78, "{run:?}");
    assert!(
        run.stderr.contains("console.auth_token = *** (from VANTAGE__CONSOLE__AUTH_TOKEN): expected a non-empty token"),
        "{run:?}"
    );
    assert!(!run.stderr.contains("tok-b71e"), "{run:?}");

    // Every key is settable from the environment, and unknown ones are refused.
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env("VANTAGE__CONSOLE__LISTN", "127.0.0.1:1");
    let run = finish(check).await;
    assert_eq!(run.code, 78, "{run:?}");
    assert!(
        run.stderr
            .contains("unknown key console.listn (from VANTAGE__CONSOLE__LISTN)"),
        "{run:?}"
    );
    assert!(run.stderr.contains("console.basic_password"), "{run:?}");

    // Debug never shows a secret either.
    let s = Settings::from_toml_str(&format!(
        "[console]\nauth_token = \"{TOKEN}\"\nbasic_user = \"ops\"\nbasic_password = \"{PASSWORD}\""
    ))
    .unwrap();
    let debug = format!("{s:?}");
    assert!(
        !debug.contains(TOKEN) && !debug.contains(PASSWORD),
        "{debug}"
    );
    assert_eq!(s.console.auth_token.as_ref().unwrap().expose(), TOKEN);
    // The redacted TOML parses back.
    assert!(Settings::from_toml_str(&s.redacted_toml()).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Actions: the CLI's operations, single and bulk

/// The id of the open dead letter of (`perspective`, `position`).
async fn open_id(env: &Env, perspective: &str, position: i64) -> String {
    let id: uuid::Uuid = sqlx::query_scalar(
        "SELECT dead_letter_id FROM wh_dead_letters \
         WHERE perspective_name = $1 AND global_position = $2",
    )
    .bind(perspective)
    .bind(position)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    id.to_string()
}

/// POSTs the single action's form as the detail page sends it; returns the 303 and the page
/// it leads to.
async fn act(
    console: &Router,
    env: &Env,
    action: &str,
    perspective: &str,
    position: i64,
) -> (String, String) {
    let id = open_id(env, perspective, position).await;
    let position = position.to_string();
    let (response, body) = send(
        console,
        form_post(
            "/actions",
            &[
                ("action", action),
                ("dead_letter_id", &id),
                ("position", &position),
                ("perspective", perspective),
            ],
            &[("sec-fetch-site", "same-origin")],
        ),
    )
    .await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER, "{body}");
    assert_secure(&response, "a 303");
    let to = location(&response);
    let page = ok(follow(console, &response).await);
    (to, page)
}

/// HTML-escaped as askama writes it.
fn escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('\'', "&#x27;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Every `tracing` line written while the guard lives, for the audit lines.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn start() -> (Captured, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    fn audit_lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .filter(|l| l.contains(console::AUDIT_TARGET))
            .map(str::to_owned)
            .collect()
    }
}

#[tokio::test]
async fn single_actions_are_the_clis_with_the_console_user_as_actor() {
    let (captured, _guard) = Captured::start();
    let env = with_dead_letters().await;
    let console = open_console(&env);
    const ACTOR: &str = "console (no authentication)";

    // The detail page of an open dead letter offers the three actions, with the CLI's warning.
    let detail = ok(get(&console, "/dead-letters/1/audit").await);
    for action in ["requeue", "replay", "purge"] {
        assert!(
            detail.contains(&format!("name=\"action\" value=\"{action}\"")),
            "{detail}"
        );
    }
    assert!(
        detail.contains(&escaped(&vantage::internals::dlq::msg::replay_warning(
            "audit", 1
        ))),
        "{detail}"
    );

    // Requeue: the CLI's message, the history row, the work row back.
    let (to, page) = act(&console, &env, "requeue", "audit", 1).await;
    assert!(to.starts_with("/dead-letters/1/audit?flash="), "{to}");
    assert!(
        page.contains(&escaped("Requeued position 1 of 'audit'.")),
        "{page}"
    );
    assert_eq!(env.status_of("audit", 1).await, "requeued");
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'audit' AND global_position = 1").await,
        1
    );
    let actors: Vec<String> = sqlx::query_scalar(
        "SELECT h.actor FROM wh_dead_letter_history h JOIN wh_dead_letters d USING (dead_letter_id) \
         WHERE d.perspective_name = 'audit' AND d.global_position = 1 AND h.kind = 'Requeued'",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(actors, vec![ACTOR.to_owned()]);
    // The page no longer offers actions on it.
    assert!(!page.contains("name=\"action\""), "{page}");

    // The same form again: the CLI's lost race, nothing done.
    let (_, page) = act(&console, &env, "requeue", "audit", 1).await;
    assert!(
        page.contains(&escaped(&vantage::internals::dlq::msg::race(1))),
        "{page}"
    );
    assert_eq!(env.history_of("audit", 1).await.len(), 2, "no new history");

    // Replay through the handler: the poison total fails again, and it stays dead-lettered.
    let (_, page) = act(&console, &env, "replay", "order_summary", 2).await;
    assert!(
        page.contains("Replay of position 2 failed again: "),
        "{page}"
    );
    assert!(page.contains("It stays dead-lettered."), "{page}");
    assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
    let kinds: Vec<String> = env
        .history_of("order_summary", 2)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, vec!["Exhausted", "ReplayFailed"]);
    // Fixed in the store, replayed again: resolved, the read model written.
    sqlx::query("UPDATE wh_event_store SET event_data = jsonb_set(event_data, '{total}', '\"2.5\"') WHERE global_position = 2")
        .execute(env.store.pool())
        .await
        .unwrap();
    let (_, page) = act(&console, &env, "replay", "order_summary", 2).await;
    assert!(
        page.contains(&escaped(
            "Replayed position 2 through 'order_summary': resolved."
        )),
        "{page}"
    );
    assert_eq!(env.status_of("order_summary", 2).await, "resolved");
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary WHERE total = 2.5")
            .await,
        1
    );

    // Replay refuses what it cannot run, as the CLI does: no statement for the type…
    let (_, page) = act(&console, &env, "replay", "audit", 4).await;
    assert!(
        page.contains(&escaped("Perspective 'audit' has no statement for event type 'OrderShipped' in this configuration; cannot replay position 4.")),
        "{page}"
    );
    assert_eq!(env.status_of("audit", 4).await, "exhausted");
    // … and no handler at all (the page says so and disables the button).
    let detail = ok(get(&console, "/dead-letters/2/legacy").await);
    let no_handler = escaped(
        "Perspective 'legacy' has no handler in this configuration; cannot replay position 2.",
    );
    assert!(detail.contains(&no_handler), "{detail}");
    assert!(detail.contains("disabled>Replay</button>"), "{detail}");
    let (_, page) = act(&console, &env, "replay", "legacy", 2).await;
    assert!(page.contains(&no_handler), "{page}");
    assert_eq!(env.status_of("legacy", 2).await, "exhausted");

    // Purge needs no handler.
    let (_, page) = act(&console, &env, "purge", "legacy", 2).await;
    assert!(page.contains("Purged position 2."), "{page}");
    assert_eq!(env.status_of("legacy", 2).await, "purged");
    let kinds: Vec<(String, Option<String>)> = env.history_of("legacy", 2).await;
    assert_eq!(kinds.last().unwrap().0, "Purged");

    // A form naming another dead letter than the position's: nothing done.
    let (response, _) = send(
        &console,
        form_post(
            "/actions",
            &[
                ("action", "purge"),
                ("dead_letter_id", &open_id(&env, "audit", 4).await),
                ("position", "2"),
                ("perspective", "order_summary"),
            ],
            &[],
        ),
    )
    .await;
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("No dead-lettered event at position 2."),
        "{page}"
    );
    assert_eq!(env.status_of("audit", 4).await, "exhausted");
    // An unknown action is a 400.
    let (response, body) = send(
        &console,
        form_post(
            "/actions",
            &[
                ("action", "delete"),
                ("dead_letter_id", &open_id(&env, "audit", 4).await),
                ("position", "4"),
                ("perspective", "audit"),
            ],
            &[],
        ),
    )
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");

    // One audit line per action, naming the actor, the action, the dead letter, the outcome.
    let lines = captured.audit_lines();
    // (The form naming no such dead letter changed nothing and is not a mutation.)
    assert_eq!(lines.len(), 7, "{lines:#?}");
    for (line, (action, outcome)) in lines.iter().zip([
        ("requeue", "requeued"),
        ("requeue", "no_longer_dead_lettered"),
        ("replay", "replay_failed"),
        ("replay", "resolved"),
        ("replay", "refused"),
        ("replay", "refused"),
        ("purge", "purged"),
    ]) {
        assert!(line.contains(" INFO "), "{line}");
        assert!(line.contains(&format!("actor={ACTOR}")), "{line}");
        assert!(line.contains(&format!("action=\"{action}\"")), "{line}");
        assert!(line.contains(&format!("outcome=\"{outcome}\"")), "{line}");
    }
}

/// The hidden `name`'s value in a form.
fn hidden(body: &str, name: &str) -> String {
    let needle = format!("name=\"{name}\" value=\"");
    let start = body
        .find(&needle)
        .unwrap_or_else(|| panic!("no hidden {name}: {body}"))
        + needle.len();
    let end = start + body[start..].find('"').unwrap();
    body[start..end].to_owned()
}

/// The confirmation form of a preview page, as the browser would send it.
fn confirmation(body: &str, filter: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut fields = vec![
        ("action".to_owned(), hidden(body, "action")),
        ("count".to_owned(), hidden(body, "count")),
        ("digest".to_owned(), hidden(body, "digest")),
    ];
    for (k, v) in filter {
        assert_eq!(hidden(body, k), *v, "the form repeats the filter");
        fields.push(((*k).to_owned(), (*v).to_owned()));
    }
    fields
}

async fn confirm(console: &Router, fields: &[(String, String)]) -> Response<Body> {
    let fields: Vec<(&str, &str)> = fields
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let (response, body) = send(
        console,
        form_post("/bulk", &fields, &[("sec-fetch-site", "same-origin")]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER, "{body}");
    response
}

#[tokio::test]
async fn a_bulk_requeue_previews_what_will_change_then_does_exactly_that() {
    let env = with_dead_letters().await;
    let console = open_console(&env);

    // The list offers the bulk actions of its filter, and says they preview first.
    let list = ok(get(&console, "/dead-letters?perspective=audit").await);
    assert!(
        list.contains("href=\"/bulk?action=requeue&amp;perspective=audit\""),
        "{list}"
    );
    assert!(list.contains("at most 1000 per confirmation"), "{list}");
    // Not for a list of closed ones.
    let closed = ok(get(&console, "/dead-letters?status=purged").await);
    assert!(!closed.contains("/bulk?"), "{closed}");

    // The preview: the server's count, what exactly changes, the filter repeated; nothing done.
    let preview = ok(get(&console, "/bulk?action=requeue&perspective=audit").await);
    assert!(
        preview.contains("<strong>2</strong> open dead letter(s) match now"),
        "{preview}"
    );
    assert!(
        preview.contains("This confirmation covers all 2 (positions 1 to 4)."),
        "{preview}"
    );
    assert_eq!(positions(&preview, "audit"), vec![1, 4]);
    assert!(positions(&preview, "order_summary").is_empty(), "{preview}");
    assert!(
        preview.contains("Requeue 2 dead letter(s)</button>"),
        "{preview}"
    );
    assert_eq!(env.status_of("audit", 1).await, "exhausted");
    let fields = confirmation(&preview, &[("perspective", "audit")]);
    assert_eq!(fields[1].1, "2");

    // Confirmed: both requeued, then the list of that filter with what was done.
    let response = confirm(&console, &fields).await;
    let to = location(&response);
    assert!(
        to.starts_with("/dead-letters?perspective=audit&flash="),
        "{to}"
    );
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("Requeued 2 of 2 dead-lettered event(s)."),
        "{page}"
    );
    assert!(page.contains("0 matching dead letter(s)."), "{page}");
    assert_eq!(env.status_of("audit", 1).await, "requeued");
    assert_eq!(env.status_of("audit", 4).await, "requeued");
    assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
    let (kind, _) = env.history_of("audit", 4).await.pop().unwrap();
    assert_eq!(kind, "Requeued");

    // Nothing left: the preview says so and offers no form.
    let preview = ok(get(&console, "/bulk?action=requeue&perspective=audit").await);
    assert!(preview.contains("No open dead letters match"), "{preview}");
    assert!(!preview.contains("<form method=\"post\""), "{preview}");

    // A bulk purge of the rest (no filter: every open one).
    let preview = ok(get(&console, "/bulk?action=purge").await);
    assert!(
        preview.contains("<strong>2</strong> open dead letter(s) match now"),
        "{preview}"
    );
    let response = confirm(&console, &confirmation(&preview, &[])).await;
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("Purged 2 of 2 dead-lettered event(s)."),
        "{page}"
    );
    assert_eq!(env.status_of("legacy", 2).await, "purged");

    // Bad requests: an unknown action, a filter on closed dead letters.
    for uri in [
        "/bulk?action=delete",
        "/bulk?action=requeue&status=purged",
        "/bulk?action=requeue&since=yesterday",
    ] {
        let (response, _) = get(&console, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert_secure(&response, uri);
    }
}

#[tokio::test]
async fn a_bulk_confirmation_is_refused_when_the_set_changed_since_the_preview() {
    let env = with_dead_letters().await;
    let console = open_console(&env);

    let preview = ok(get(&console, "/bulk?action=requeue").await);
    let fields = confirmation(&preview, &[]);
    assert_eq!(fields[1].1, "4");

    // Another operator purges one meanwhile: the count differs.
    let id: uuid::Uuid = open_id(&env, "legacy", 2).await.parse().unwrap();
    assert!(env
        .store
        .purge_dead_letter(id, "someone else")
        .await
        .unwrap());
    let response = confirm(&console, &fields).await;
    let to = location(&response);
    assert!(to.starts_with("/bulk?action=requeue&flash="), "{to}");
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("The matching dead letters changed since the preview: 4 matched then, 3 match now. Nothing was done"),
        "{page}"
    );
    // The new preview is shown, with the new count.
    assert!(
        page.contains("<strong>3</strong> open dead letter(s) match now"),
        "{page}"
    );
    for (p, n) in [("order_summary", 2), ("audit", 1), ("audit", 4)] {
        assert_eq!(env.status_of(p, n).await, "exhausted", "{p} {n}");
    }

    // The same count but not the same ones: one gone, another dead-lettered.
    let fields = confirmation(&page, &[]);
    let id: uuid::Uuid = open_id(&env, "audit", 1).await.parse().unwrap();
    assert!(env
        .store
        .purge_dead_letter(id, "someone else")
        .await
        .unwrap());
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;
    let response = confirm(&console, &fields).await;
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("changed since the preview: 3 match, as before, but not the same ones. Nothing was done"),
        "{page}"
    );
    assert_eq!(env.status_of("order_summary", 1).await, "exhausted");
    assert_eq!(env.status_of("audit", 4).await, "exhausted");
}

#[tokio::test]
async fn a_bulk_action_covers_at_most_the_limit_and_says_so() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    // 1000 more open dead letters of audit, positions 1001…2000 (copies of position 1's).
    sqlx::query(
        "INSERT INTO wh_dead_letters (dead_letter_id, source_table, source_id, stream_id, event_id, \
             global_position, stream_version, event_type, perspective_name, failure_reason, \
             error_text, attempts_when_dlq, failures_when_dlq) \
         SELECT gen_random_uuid(), source_table, gen_random_uuid(), stream_id, gen_random_uuid(), \
             1000 + g, stream_version, event_type, perspective_name, failure_reason, error_text, \
             attempts_when_dlq, failures_when_dlq \
         FROM wh_dead_letters, generate_series(1, 1000) g \
         WHERE perspective_name = 'audit' AND global_position = 1",
    )
    .execute(env.store.pool())
    .await
    .unwrap();

    let preview = ok(get(&console, "/bulk?action=purge&perspective=audit").await);
    assert!(
        preview.contains("<strong>1002</strong> open dead letter(s) match now"),
        "{preview}"
    );
    assert!(
        preview.contains("covers the <strong>1000</strong> with the lowest positions (1 to 1998): at most 1000 are changed per confirmation"),
        "{preview}"
    );
    assert!(preview.contains("… and 975 more"), "{preview}");
    assert_eq!(positions(&preview, "audit").len(), 25, "the sample");
    let response = confirm(
        &console,
        &confirmation(&preview, &[("perspective", "audit")]),
    )
    .await;
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("Purged 1000 of 1000 dead-lettered event(s). 2 more match the filter (at most 1000 per confirmation); open the preview again"),
        "{page}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'audit' AND status = 'exhausted'").await,
        2
    );
    assert_eq!(
        env.scalar("SELECT min(global_position) FROM wh_dead_letters WHERE perspective_name = 'audit' AND status = 'exhausted'").await,
        1999
    );
}

#[tokio::test]
async fn read_only_mode_refuses_every_action_and_shows_no_button() {
    let env = with_dead_letters().await;
    let console = console_with(
        &env,
        &ConsoleSettings {
            read_only: true,
            ..ConsoleSettings::default()
        },
    );
    let detail = ok(get(&console, "/dead-letters/1/audit").await);
    assert!(!detail.contains("<form method=\"post\""), "{detail}");
    assert!(!detail.contains("<button"), "{detail}");
    let list = ok(get(&console, "/dead-letters").await);
    assert!(!list.contains("/bulk?"), "{list}");

    let (response, body) = get(&console, "/bulk?action=requeue").await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("read-only"), "{body}");
    let id = open_id(&env, "audit", 1).await;
    for request in [
        form_post(
            "/actions",
            &[
                ("action", "requeue"),
                ("dead_letter_id", &id),
                ("position", "1"),
                ("perspective", "audit"),
            ],
            &[("sec-fetch-site", "same-origin")],
        ),
        form_post(
            "/bulk",
            &[("action", "requeue"), ("count", "4"), ("digest", "x")],
            &[("sec-fetch-site", "same-origin")],
        ),
    ] {
        let (response, body) = send(&console, request).await;
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{body}");
        assert!(body.contains("read-only"), "{body}");
        assert_secure(&response, "read-only");
    }
    assert_eq!(env.status_of("audit", 1).await, "exhausted");
}

#[tokio::test]
async fn actions_need_credentials_and_name_the_user_in_the_history() {
    let env = with_dead_letters().await;
    let console = console_with(
        &env,
        &ConsoleSettings {
            basic_user: Some("ops".into()),
            basic_password: Some(Secret::new("pw")),
            ..ConsoleSettings::default()
        },
    );
    let id = open_id(&env, "audit", 1).await;
    let fields = [
        ("action", "purge"),
        ("dead_letter_id", id.as_str()),
        ("position", "1"),
        ("perspective", "audit"),
    ];
    let (response, _) = send(&console, form_post("/actions", &fields, &[])).await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let (response, _) = get(&console, "/bulk?action=purge").await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(env.status_of("audit", 1).await, "exhausted");

    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("ops:pw")
    );
    let (response, _) = send(
        &console,
        form_post("/actions", &fields, &[("authorization", basic.as_str())]),
    )
    .await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(env.status_of("audit", 1).await, "purged");
    let actor: String =
        sqlx::query_scalar("SELECT actor FROM wh_dead_letter_history WHERE kind = 'Purged'")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(actor, "console user ops");
}

#[tokio::test]
async fn credentials_can_come_from_files_and_are_never_shown() {
    let env = Env::new().await;
    const TOKEN: &str = "tok-5e0c-from-a-file";
    let token_file = env.dir.path().join("console-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut check = base_command();
    check
        .args(["--config"])
        .arg(&env.config)
        .args(["config", "check"])
        .env("VANTAGE__CONSOLE__LISTEN", "0.0.0.0:9465")
        .env("VANTAGE__CONSOLE__AUTH_TOKEN_FILE", &token_file);
    let run = finish(check).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        !run.stdout.contains(TOKEN) && !run.stderr.contains(TOKEN),
        "{run:?}"
    );
    assert!(
        run.stdout
            .contains(&format!("auth_token_file = \"{}\"", token_file.display())),
        "{run:?}"
    );

    let settings = Settings::load(&vantage::config::LoadOptions {
        config_path: Some(env.config.clone()),
        overrides: vec![(
            "console.auth_token_file".into(),
            token_file.display().to_string(),
        )],
        ..Default::default()
    })
    .unwrap();
    let console = console::router(ConsoleState::new(
        env.store.with_statement_timeout(console::STATEMENT_TIMEOUT),
        &settings,
    ));
    let (response, _) = get(&console, "/").await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let request = Request::get("/")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let (response, body) = send(&console, request).await;
    assert_eq!(response.status(), StatusCode::OK, "{body}");
}

// ---------------------------------------------------------------------------------------------
// Triage (issue 11): error groups, blocked lanes, paused perspectives

/// Dead letters in two groups: order_summary 1 and 2 (the same numeric error with different
/// values), audit 3 (another error).
async fn with_groups() -> Env {
    let env = seeded().await;
    for (position, value) in [(1, "abc"), (2, "x1")] {
        env.dead_letter_with_error(
            "order_summary",
            position,
            "MaxAttemptsExceeded",
            &format!("invalid input syntax for type numeric: \"{value}\" (SQLSTATE 22P02)"),
        )
        .await;
    }
    env.dead_letter_with_error("audit", 3, "PermanentFailure", "boom at 12")
        .await;
    env
}

async fn fingerprint_of(env: &Env, perspective: &str, position: i64) -> String {
    sqlx::query_scalar(
        "SELECT error_fingerprint FROM wh_dead_letters \
         WHERE perspective_name = $1 AND global_position = $2",
    )
    .bind(perspective)
    .bind(position)
    .fetch_one(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn error_groups_are_listed_biggest_first_and_acted_on_through_the_bulk_preview() {
    let env = with_groups().await;
    let console = open_console(&env);
    let numeric = fingerprint_of(&env, "order_summary", 1).await;
    let other = fingerprint_of(&env, "audit", 3).await;
    assert_eq!(numeric, fingerprint_of(&env, "order_summary", 2).await);
    assert_ne!(numeric, other);

    let (response, page) = get(&console, "/groups").await;
    assert_eq!(response.status(), StatusCode::OK, "{page}");
    assert_secure(&response, "/groups");
    assert!(
        page.contains("3 open dead letter(s) in 2 group(s)."),
        "{page}"
    );
    let (first, second) = (page.find(&numeric).unwrap(), page.find(&other).unwrap());
    assert!(first < second, "biggest first: {page}");
    assert!(
        page.contains("invalid input syntax for type numeric: &quot;?&quot;")
            || page.contains("invalid input syntax for type numeric: &#34;?&#34;"),
        "{page}"
    );
    assert!(page.contains("22P02"), "{page}");
    assert!(
        page.contains(&format!(
            "href=\"/bulk?action=requeue&amp;group={numeric}\""
        )),
        "{page}"
    );
    // The list filtered by the group.
    let list = ok(get(&console, &format!("/dead-letters?group={numeric}")).await);
    assert!(list.contains("2 matching dead letter(s)."), "{list}");
    assert_eq!(positions(&list, "order_summary"), vec![2, 1]);
    assert!(positions(&list, "audit").is_empty(), "{list}");
    // One perspective only.
    let audit = ok(get(&console, "/groups?perspective=audit").await);
    assert!(
        !audit.contains(&numeric) && audit.contains(&other),
        "{audit}"
    );

    // Requeue the group: the preview's count, then exactly those.
    let preview = ok(get(&console, &format!("/bulk?action=requeue&group={numeric}")).await);
    assert!(
        preview.contains("<strong>2</strong> open dead letter(s) match now"),
        "{preview}"
    );
    let response = confirm(&console, &confirmation(&preview, &[("group", &numeric)])).await;
    let page = ok(follow(&console, &response).await);
    assert!(
        page.contains("Requeued 2 of 2 dead-lettered event(s)."),
        "{page}"
    );
    assert_eq!(env.status_of("order_summary", 1).await, "requeued");
    assert_eq!(env.status_of("order_summary", 2).await, "requeued");
    assert_eq!(env.status_of("audit", 3).await, "exhausted");
    let page = ok(get(&console, "/groups").await);
    assert!(
        page.contains("1 open dead letter(s) in 1 group(s)."),
        "{page}"
    );

    // Read-only: the groups, no action.
    let read_only = console_with(
        &env,
        &ConsoleSettings {
            read_only: true,
            ..ConsoleSettings::default()
        },
    );
    let page = ok(get(&read_only, "/groups").await);
    assert!(page.contains(&other) && !page.contains("/bulk?"), "{page}");
}

#[tokio::test]
async fn blocked_lanes_and_paused_perspectives_are_shown() {
    let env = seeded().await;
    let console = open_console(&env);
    let page = ok(get(&console, "/blocked").await);
    assert!(page.contains("No blocked lanes."), "{page}");

    // The head of order_summary's stream A lane fails; position 2 waits behind it.
    sqlx::query(
        "UPDATE wh_perspective_events SET failures = 2, attempts = 2, \
             last_error = 'invalid input syntax for type numeric: \"abc\" (SQLSTATE 22P02)', \
             scheduled_for = now() + interval '1 hour' \
         WHERE perspective_name = 'order_summary' AND global_position = 1",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    let (response, page) = get(&console, "/blocked").await;
    assert_eq!(response.status(), StatusCode::OK, "{page}");
    assert_secure(&response, "/blocked");
    assert!(
        page.contains("<strong>1</strong> blocked lane(s) holding <strong>1</strong> event(s)"),
        "{page}"
    );
    assert!(page.contains(&support::STREAM_A.to_string()), "{page}");
    assert!(page.contains("href=\"/dead-letters?group="), "{page}");
    assert!(page.contains("in 59m") || page.contains("in 1h"), "{page}");
    let only_audit = ok(get(&console, "/blocked?perspective=audit").await);
    assert!(only_audit.contains("No blocked lanes."), "{only_audit}");

    // The overview links to it, and shows a paused perspective with its reason.
    let overview = ok(get(&console, "/").await);
    assert!(
        overview
            .contains("<a class=\"alert\" href=\"/blocked?perspective=order_summary\">1 (1)</a>"),
        "{overview}"
    );
    env.store
        .pause_perspective("audit", Some("schema change"), "operator x@y")
        .await
        .unwrap();
    let overview = ok(get(&console, "/").await);
    assert!(overview.contains("paused since "), "{overview}");
    assert!(
        overview.contains(" by operator x@y: schema change"),
        "{overview}"
    );
}

#[tokio::test]
async fn the_detail_page_previews_a_replay_without_writing_anything() {
    let env = seeded().await;
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    let console = open_console(&env);

    let page = ok(get(&console, "/dead-letters/1/order_summary").await);
    assert!(
        page.contains("formaction=\"/dead-letters/1/order_summary#replay-preview\" name=\"preview\" value=\"replay\""),
        "{page}"
    );
    assert!(!page.contains("What a replay would change"), "{page}");

    let page = ok(preview_replay(&console, "/dead-letters/1/order_summary").await);
    assert!(page.contains("What a replay would change"), "{page}");
    assert!(
        page.contains("The handler succeeds: a replay would resolve position 1."),
        "{page}"
    );
    assert!(
        page.contains("<td>public.order_summary</td><td>order_id</td>"),
        "{page}"
    );
    assert!(page.contains("<pre>(none)</pre>"), "{page}");
    assert!(page.contains(support::ORDER_1), "{page}");

    let page = ok(preview_replay(&console, "/dead-letters/2/order_summary").await);
    assert!(
        page.contains("The handler fails: invalid input syntax for type numeric"),
        "{page}"
    );

    // Nothing was written, no history.
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary")
            .await,
        0
    );
    assert_eq!(env.status_of("order_summary", 1).await, "exhausted");
    assert_eq!(env.history_of("order_summary", 1).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Hardening (issue 19)

/// Defect 3: a confirmed bulk action finishes, and says what it did, even when the request
/// that started it goes away part-way (before: the walk stopped with the request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_action_finishes_when_its_request_goes_away() {
    let env = Env::with_extra_config(
        "\n[[perspectives]]\nname = \"slow\"\nevents = [\"OrderPlaced\", \"OrderShipped\"]\n\
         [perspectives.sql]\nOrderPlaced = \"SELECT pg_sleep(0.4)\"\nOrderShipped = \"SELECT pg_sleep(0.4)\"\n",
    )
    .await;
    env.store
        .register_perspective("slow", &["OrderPlaced".into(), "OrderShipped".into()])
        .await
        .unwrap();
    let a = env
        .append(
            STREAM_A,
            &[("OrderPlaced", json!({})), ("OrderPlaced", json!({}))],
        )
        .await;
    let b = env
        .append(
            STREAM_B,
            &[("OrderPlaced", json!({})), ("OrderShipped", json!({}))],
        )
        .await;
    let positions: Vec<i64> = a.iter().chain(&b).map(|e| e.global_position).collect();
    for &p in &positions {
        env.dead_letter("slow", p, "MaxAttemptsExceeded").await;
    }
    let console = open_console(&env);
    let preview = ok(get(&console, "/bulk?action=replay&perspective=slow").await);
    let fields = confirmation(&preview, &[("perspective", "slow")]);
    // The client gives up while the first replay runs.
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_millis(600),
        confirm(&console, &fields),
    )
    .await;
    assert!(gave_up.is_err(), "the bulk replay took longer than that");
    let started = std::time::Instant::now();
    loop {
        let mut open = 0;
        for &p in &positions {
            if env.status_of("slow", p).await == "exhausted" {
                open += 1;
            }
        }
        if open == 0 {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "{open} of 4 stayed dead-lettered: the walk stopped with its request"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The detail page's preview button, as the browser sends it (same origin).
async fn preview_replay(console: &Router, uri: &str) -> (Response<Body>, String) {
    send(
        console,
        form_post(
            uri,
            &[("preview", "replay")],
            &[("sec-fetch-site", "same-origin")],
        ),
    )
    .await
}

/// Defect 7: a GET never runs a perspective's statement (the replay preview executes it, rolled
/// back: an action), and a read-only console runs none at all.
#[tokio::test]
async fn a_replay_preview_runs_only_on_a_same_origin_post_and_never_when_read_only() {
    let env = seeded().await;
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;
    let console = open_console(&env);
    for method in ["GET", "HEAD"] {
        let request = Request::builder()
            .method(method)
            .uri("/dead-letters/1/order_summary?preview=replay")
            .header(header::HOST, "127.0.0.1:9465")
            .body(Body::empty())
            .unwrap();
        let (response, body) = send(&console, request).await;
        assert_eq!(response.status(), StatusCode::OK, "{body}");
        assert!(!body.contains("What a replay would change"), "{body}");
    }
    // A cross-site POST is refused before anything runs.
    let (response, _) = send(
        &console,
        form_post(
            "/dead-letters/1/order_summary",
            &[("preview", "replay")],
            &[("sec-fetch-site", "cross-site")],
        ),
    )
    .await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    // Read-only: refused, nothing run.
    let read_only = console_with(
        &env,
        &ConsoleSettings {
            read_only: true,
            ..ConsoleSettings::default()
        },
    );
    let (response, body) = preview_replay(&read_only, "/dead-letters/1/order_summary").await;
    assert_eq!(response.status(), StatusCode::FORBIDDEN, "{body}");
    assert!(!body.contains("What a replay would change"), "{body}");
    // A same-origin POST on a console that may act: the preview.
    let page = ok(preview_replay(&console, "/dead-letters/1/order_summary").await);
    assert!(page.contains("What a replay would change"), "{page}");
}

/// Defect 8: what a page renders of a dead letter's texts is capped (64 KiB each and "… (N
/// bytes more)"), whatever was stored: a 1 MB error and payload make no 1 MB page.
#[tokio::test]
async fn the_detail_page_caps_huge_texts() {
    let env = seeded().await;
    let big = "y".repeat(1_000_000);
    let appended = env
        .append(
            uuid::Uuid::new_v4(),
            &[("OrderPlaced", json!({ "big": big }))],
        )
        .await;
    let n = appended[0].global_position;
    env.dead_letter_with_error("audit", n, "MaxAttemptsExceeded", &big)
        .await;
    let console = open_console(&env);
    let page = ok(get(&console, &format!("/dead-letters/{n}/audit")).await);
    assert!(page.len() < 400_000, "the page is {} bytes", page.len());
    assert!(page.contains("bytes more)"), "the cut is said");
}

/// Defect 9: a NUL byte or an out-of-range date in a filter is the request's error (400 naming
/// the parameter), not "try again" (503): the database answered, and a retry cannot help.
#[tokio::test]
async fn nul_bytes_and_out_of_range_dates_are_bad_requests() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    for (uri, name) in [
        ("/dead-letters?error=%00", "error"),
        ("/dead-letters?event_type=a%00b", "event_type"),
        ("/dead-letters/1/p%00", "path"),
        ("/groups?perspective=%00", "perspective"),
        ("/blocked?perspective=%00", "perspective"),
        ("/bulk?action=requeue&reason=%00", "reason"),
        ("/dead-letters?since=-4713-01-01", "since"),
        ("/dead-letters?until=99999-01-01", "until"),
    ] {
        let (response, body) = get(&console, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}: {body}");
        assert!(body.contains(name), "{uri} names {name}: {body}");
    }
    // A bulk confirmation with a NUL in its filter: 400 too.
    let (response, body) = send(
        &console,
        form_post(
            "/bulk",
            &[
                ("action", "requeue"),
                ("count", "1"),
                ("digest", "x"),
                ("perspective", "a\0b"),
            ],
            &[("sec-fetch-site", "same-origin")],
        ),
    )
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("perspective"), "{body}");
}

/// Defect 16: no redirect or link echoes unbounded input: a parameter longer than 4 KiB is a
/// 400 naming it (before: a 1 MB `Location`).
#[tokio::test]
async fn overlong_parameters_are_refused_and_never_echoed() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    let long = "p".repeat(1_000_000);
    let (response, body) = send(
        &console,
        form_post(
            "/bulk",
            &[
                ("action", "requeue"),
                ("count", "1"),
                ("digest", "x"),
                ("perspective", &long),
            ],
            &[("sec-fetch-site", "same-origin")],
        ),
    )
    .await;
    assert_eq!(
        response.status(),
        StatusCode::BAD_REQUEST,
        "{}",
        &body[..200]
    );
    assert!(response.headers().get(header::LOCATION).is_none());
    assert!(
        body.contains("perspective is longer than 4 KiB"),
        "{}",
        &body[..body.len().min(2000)]
    );
    assert!(body.len() < 20_000);
    let (response, _) = get(
        &console,
        &format!("/dead-letters?error={}", "e".repeat(5000)),
    )
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}

/// How many lock requests on `wh_dead_letters` in `mode` wait (are not granted).
async fn dead_letter_lock_waiters(env: &Env, mode: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks \
         WHERE relation = 'wh_dead_letters'::regclass AND mode = $1 AND NOT granted",
    )
    .bind(mode)
    .fetch_one(env.store.pool())
    .await
    .unwrap()
}

/// Waits (polling the lock table, up to 20 s) until `n` requests in `mode` wait.
async fn until_lock_waiters(env: &Env, mode: &str, n: i64) {
    let started = std::time::Instant::now();
    while dead_letter_lock_waiters(env, mode).await < n {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "no {mode} request on wh_dead_letters is waiting"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Item 14: the count and the set a bulk confirmation compares with its preview come from one
/// snapshot, so a refusal never gives a reason that was true of neither. Made deterministic
/// with table locks: the confirmation's first read waits behind a lock the test holds, a second
/// lock request (the "other operator") queues behind that read, and gets the table the moment
/// the read is done: it purges one of the two letters before anything else of the confirmation
/// can read. Before: the count (2) was read before the purge and the set (1 letter) after it,
/// and the refusal said "2 match, as before, but not the same ones" — neither then nor now.
/// And on a connection the statement was new to, its preparation (an exchange of its own) took
/// and let go of the lock before the read, so the purge came first now and then (under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_confirmation_reads_its_count_and_its_set_in_one_snapshot() {
    let env = with_dead_letters().await;
    let console = open_console(&env);
    let preview = ok(get(&console, "/bulk?action=requeue&perspective=audit").await);
    let fields = confirmation(&preview, &[("perspective", "audit")]);
    assert_eq!(fields[1].1, "2");
    let audit_1: uuid::Uuid = open_id(&env, "audit", 1).await.parse().unwrap();
    // The confirmation comes on a connection the statement is new to (another console process,
    // or a pool that opened a connection): it is prepared first, and that waits for the lock
    // too.
    let console = open_console(&env);

    // The test holds the table; the confirmation's first read waits for it.
    let mut holder = env.store.pool().begin().await.unwrap();
    sqlx::query("LOCK TABLE wh_dead_letters IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let confirming = {
        let console = console.clone();
        tokio::spawn(async move { confirm(&console, &fields).await })
    };
    until_lock_waiters(&env, "AccessShareLock", 1).await;
    // The other operator queues behind that read.
    let other = {
        let pool = env.store.pool().clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("LOCK TABLE wh_dead_letters IN ACCESS EXCLUSIVE MODE")
                .execute(&mut *tx)
                .await
                .unwrap();
            let purged: bool = sqlx::query_scalar("SELECT purge_dead_letter($1, 'someone else')")
                .bind(audit_1)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            purged
        })
    };
    until_lock_waiters(&env, "AccessExclusiveLock", 1).await;
    holder.commit().await.unwrap();
    assert!(other.await.unwrap(), "the other operator purged audit 1");
    let response = confirming.await.unwrap();
    let page = ok(follow(&console, &response).await);

    assert!(
        !page.contains("as before, but not the same ones"),
        "the reason was true of no moment: {page}"
    );
    // The snapshot was the preview's set: the action ran, and says the purged one was skipped.
    assert!(
        page.contains("Requeued 1 of 2 dead-lettered event(s)."),
        "{page}"
    );
    assert!(
        page.contains("1 of 2 dead-lettered event(s) were no longer dead-lettered"),
        "{page}"
    );
    assert_eq!(env.status_of("audit", 1).await, "purged");
    assert_eq!(env.status_of("audit", 4).await, "requeued");
}

/// The characters a console page must never contain as they are (item 17): they make one name
/// render as another (bidi overrides, embeddings and isolates; zero-width characters; the
/// byte-order mark) or are invisible controls.
fn is_disguise(c: char) -> bool {
    matches!(c,
        '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{2064}'
        | '\u{2066}'..='\u{2069}' | '\u{FEFF}' | '\u{061C}')
        || (c.is_control() && c != '\n' && c != '\t')
}

#[track_caller]
fn assert_no_disguise(page: &str, what: &str) {
    let found: Vec<String> = page
        .chars()
        .filter(|c| is_disguise(*c))
        .map(|c| format!("U+{:04X}", u32::from(c)))
        .collect();
    assert!(
        found.is_empty(),
        "{what} renders {found:?} as they are: {page}"
    );
}

/// Item 17, the console half: bidi overrides, zero-width characters and controls from
/// producers (event type, error text, payload) are shown escaped, visibly marked, on every page
/// (as `\u{202e}`, the CLI's spelling); in an attribute they stay the character itself (as a
/// reference), so a form that repeats a filter still selects the same dead letters.
#[tokio::test]
async fn bidi_and_zero_width_characters_are_shown_escaped_on_every_page() {
    let env = seeded().await;
    let disguised = "Order\u{202e}dekcalP";
    let appended = env
        .append(
            STREAM_A,
            &[(
                disguised,
                json!({ "note": "a\u{2066}b\u{feff}c\u{200b}d", "bell": "\u{7}" }),
            )],
        )
        .await;
    let n = appended[0].global_position;
    env.dead_letter_with_error(
        "audit",
        n,
        "MaxAttemptsExceeded",
        "invalid input: \"x\u{200d}y\u{2069}\" (SQLSTATE 22P02)",
    )
    .await;
    let console = open_console(&env);
    let escaped_type = "Order<span class=\"esc\" title=\"U+202E\">\\u{202e}</span>dekcalP";

    let filter: String = url::form_urlencoded::byte_serialize(disguised.as_bytes()).collect();
    for uri in [
        "/".to_owned(),
        "/dead-letters".to_owned(),
        format!("/dead-letters?event_type={filter}"),
        format!("/dead-letters/{n}/audit"),
        "/groups".to_owned(),
        format!("/bulk?action=requeue&event_type={filter}"),
    ] {
        let page = ok(get(&console, &uri).await);
        assert_no_disguise(&page, &uri);
        if uri != "/" {
            assert!(page.contains(escaped_type), "{uri}: {page}");
        }
    }
    let detail = ok(get(&console, &format!("/dead-letters/{n}/audit")).await);
    // (The payload's BEL is JSON's to escape: `\u0007`.)
    for shown in [
        "\\u{2066}",
        "\\u{feff}",
        "\\u{200b}",
        "\\u{200d}",
        "\\u{2069}",
        "\\u0007",
    ] {
        assert!(detail.contains(shown), "{shown}: {detail}");
    }

    // The bulk form repeats the filter with the character itself: the confirmation selects the
    // same dead letter and acts on it.
    let preview = ok(get(
        &console,
        &format!("/bulk?action=requeue&event_type={filter}"),
    )
    .await);
    assert!(
        preview.contains("name=\"event_type\" value=\"Order&#x202e;dekcalP\""),
        "{preview}"
    );
    let mut fields = confirmation(&preview, &[]);
    fields.push(("event_type".to_owned(), disguised.to_owned()));
    let response = confirm(&console, &fields).await;
    let page = ok(follow(&console, &response).await);
    assert_no_disguise(&page, "the list after the bulk requeue");
    assert!(
        page.contains("Requeued 1 of 1 dead-lettered event(s)."),
        "{page}"
    );
    assert_eq!(env.status_of("audit", n).await, "requeued");
}

// ---------------------------------------------------------------------------------------------
// Probes under attack (issue 19: "the probes answer ≥ 99 % of requests during a bounded attack
// of every shape")

mod attack {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio_util::sync::CancellationToken;

    /// Slowloris: half-open request heads that never end.
    pub const HALF_OPEN: usize = 300;
    /// Connections that get one answer, then send one byte of a next request.
    pub const ONE_BYTE: usize = 256;
    /// Long requests: complete heads whose body (announced, 1 000 bytes) trickles a byte per
    /// 400 ms, so each would be served only after the body timeout.
    pub const LONG: usize = 256;
    /// Unauthenticated floods: clients sending complete requests without credentials, each
    /// answered at once, back to back.
    pub const FLOODERS: usize = 4;
    /// Before reconnecting, an attacker whose connection was closed waits this long (the attack
    /// is bounded; what matters is that it comes back in the same shape).
    const COMEBACK: Duration = Duration::from_millis(20);

    /// Reads until the server closes the connection (or the attack stops).
    async fn until_closed(s: &mut TcpStream, stop: &CancellationToken) {
        let mut buf = [0u8; 4096];
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                read = s.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                },
            }
        }
    }

    /// Reads one response head (up to its blank line).
    async fn one_answer(s: &mut TcpStream) -> bool {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        while !raw.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
        true
    }

    /// Starts every shape of the attack on `addr`; `answered` is a request that the server
    /// answers without credentials (a 200 on the probes, a 401 on a console with credentials).
    /// Returns how many attackers have connected at least once.
    pub fn start(
        addr: SocketAddr,
        answered: &'static str,
        stop: &CancellationToken,
    ) -> Arc<AtomicUsize> {
        let started = Arc::new(AtomicUsize::new(0));
        let spawn = |shape: u8| {
            let stop = stop.clone();
            let started = Arc::clone(&started);
            tokio::spawn(async move {
                let mut first = true;
                while !stop.is_cancelled() {
                    if let Ok(mut s) = TcpStream::connect(addr).await {
                        let sent = match shape {
                            0 => s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await.is_ok(),
                            1 => {
                                s.write_all(answered.as_bytes()).await.is_ok()
                                    && one_answer(&mut s).await
                                    && s.write_all(b"G").await.is_ok()
                            }
                            2 => s
                                .write_all(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
                                .await
                                .is_ok(),
                            _ => {
                                // A flood: request after request on one connection.
                                let mut ok = true;
                                while ok && !stop.is_cancelled() {
                                    ok = s.write_all(answered.as_bytes()).await.is_ok()
                                        && one_answer(&mut s).await;
                                    if ok && first {
                                        first = false;
                                        started.fetch_add(1, Ordering::SeqCst);
                                    }
                                }
                                ok
                            }
                        };
                        if first && sent {
                            first = false;
                            started.fetch_add(1, Ordering::SeqCst);
                        }
                        if shape == 2 {
                            // The body, a byte at a time, until the server gives up on it.
                            let mut buf = [0u8; 1024];
                            loop {
                                tokio::select! {
                                    () = stop.cancelled() => break,
                                    read = s.read(&mut buf) => if matches!(read, Ok(0) | Err(_)) { break },
                                    () = tokio::time::sleep(Duration::from_millis(400)) => {
                                        if s.write_all(b"x").await.is_err() { break }
                                    }
                                }
                            }
                        } else {
                            until_closed(&mut s, &stop).await;
                        }
                    }
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(COMEBACK) => {}
                    }
                }
            });
        };
        for _ in 0..HALF_OPEN {
            spawn(0);
        }
        for _ in 0..ONE_BYTE {
            spawn(1);
        }
        for _ in 0..LONG {
            spawn(2);
        }
        for _ in 0..FLOODERS {
            spawn(3);
        }
        started
    }

    /// Every attacker has connected once (counted, not timed).
    pub async fn established(started: &AtomicUsize) {
        let all = HALF_OPEN + ONE_BYTE + LONG + FLOODERS;
        let since = std::time::Instant::now();
        while started.load(Ordering::SeqCst) < all {
            assert!(
                since.elapsed() < Duration::from_secs(60),
                "only {} of {all} attackers connected",
                started.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `n` probes (`request`, each on a new connection, each with its own timeout of
    /// 3 s), one after the other, from a thread of their own (as a kubelet probes from another
    /// process: the attackers' tasks do not delay the probe's own writes); returns how many
    /// were answered with `HTTP/1.1 200`.
    pub async fn probes(addr: SocketAddr, request: &str, n: usize) -> usize {
        use std::io::{Read as _, Write as _};
        let request = request.to_owned();
        tokio::task::spawn_blocking(move || {
            let limit = Duration::from_secs(3);
            let mut answered = 0;
            for _ in 0..n {
                let probe = || -> std::io::Result<bool> {
                    let started = std::time::Instant::now();
                    let mut s = std::net::TcpStream::connect_timeout(&addr, limit)?;
                    s.set_write_timeout(Some(limit))?;
                    s.write_all(request.as_bytes())?;
                    let mut raw = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        let left = limit.saturating_sub(started.elapsed());
                        if left.is_zero() {
                            return Ok(false);
                        }
                        s.set_read_timeout(Some(left))?;
                        match s.read(&mut buf)? {
                            0 => break,
                            k => raw.extend_from_slice(&buf[..k]),
                        }
                    }
                    Ok(raw.starts_with(b"HTTP/1.1 200"))
                };
                match probe() {
                    Ok(true) => answered += 1,
                    other => eprintln!("a probe was not answered: {other:?}"),
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            answered
        })
        .await
        .expect("the probes' thread")
    }
}

/// Probes sent during the attack; at least 99 % must be answered.
const PROBES: usize = 100;

/// The daemon's probes (`/healthz` on `http.listen`) answer during an attack of every shape at
/// once: slowloris heads, 256 connections holding one byte of a next request, 256 long requests
/// whose body trickles, and floods of requests (issue 19, defect 2 and its "done when").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_answer_during_an_attack_of_every_shape() {
    use vantage::internals::telemetry::{health::Health, http, recorder};
    let (listener, addr) = http::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(http::serve_on(
        listener,
        http::HttpState::new(recorder::install().unwrap(), Health::new()),
        stop.clone(),
    ));
    let attack = tokio_util::sync::CancellationToken::new();
    let started = attack::start(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        &attack,
    );
    attack::established(&started).await;
    let answered = attack::probes(
        addr,
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        PROBES,
    )
    .await;
    attack.cancel();
    eprintln!("probes under attack: {answered} of {PROBES} answered");
    assert!(
        answered * 100 >= PROBES * 99,
        "{answered} of {PROBES} probes answered during the attack"
    );
    stop.cancel();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(30), server).await;
}

/// The console's listener, with credentials configured: an authenticated operator is answered
/// during the same attack, its floods being unauthenticated requests (answered 401).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_is_answered_during_an_attack_of_every_shape() {
    const TOKEN: &str = "tok-attack-not-for-pages";
    let env = Env::new().await;
    let store = env.store.with_statement_timeout(console::STATEMENT_TIMEOUT);
    let (listener, addr) = console::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let settings = ConsoleSettings {
        auth_token: Some(Secret::new(TOKEN)),
        ..ConsoleSettings::default()
    };
    let server = tokio::spawn(console::serve(
        listener,
        ConsoleState::new(store, &settings_with(&env, &settings)),
        stop.clone(),
    ));
    let attack = tokio_util::sync::CancellationToken::new();
    let started = attack::start(addr, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", &attack);
    attack::established(&started).await;
    let request = format!(
        "GET /console.css HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n"
    );
    let answered = attack::probes(addr, &request, PROBES).await;
    attack.cancel();
    eprintln!("operator under attack: {answered} of {PROBES} answered");
    assert!(
        answered * 100 >= PROBES * 99,
        "{answered} of {PROBES} operator requests answered during the attack"
    );
    stop.cancel();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(30), server).await;
}

#[tokio::test]
async fn overview_lists_each_version_of_a_versioned_perspective() {
    let env = seeded().await;
    let console = open_console(&env);
    let before = ok(get(&console, "/").await);
    assert!(!before.contains("<h2>Versions</h2>"), "{before}");
    let register = |version: i32| {
        format!(
            "SELECT created FROM register_perspective_version('orders', {version}, 'rm', \
             ARRAY['orders'], ARRAY['Placed'], \
             '{{\"Placed\": \"INSERT INTO orders (id) VALUES ($2) ON CONFLICT DO NOTHING\"}}', \
             'CREATE TABLE orders (id uuid PRIMARY KEY)')"
        )
    };
    env.exec(&register(1)).await;
    // Backfilled to the end: the first version goes live by itself.
    let started = std::time::Instant::now();
    while env
        .scalar(
            "SELECT count(*) FROM backfill_perspective_version('orders', 1, 1000) \
             WHERE outcome IN ('live', 'ready')",
        )
        .await
        == 0
    {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "never live"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    env.exec(&register(2)).await;
    let body = ok(get(&console, "/").await);
    assert!(body.contains("<h2>Versions</h2>"), "{body}");
    let row = |version: &str, state: &str| {
        format!("<td>orders</td>\n<td class=\"num\">{version}</td>\n<td>{state}</td>")
    };
    assert!(
        body.contains(&row("1", "<span class=\"badge\">live</span>")),
        "{body}"
    );
    assert!(body.contains(&row("2", "building")), "{body}");
    assert!(body.contains("<code>orders_v2</code>"), "{body}");
}

/// Issue 23, item 3: the overview, a perspective's page and the groups show inline SVG charts
/// from the sample history and the dead letters' arrivals; `window` is validated (400 names
/// it); a perspective's name is escaped on its page, and an unknown one is a 404.
#[tokio::test]
async fn charts_on_the_overview_a_perspective_page_and_the_groups() {
    let env = with_dead_letters().await;
    // Ten minutes of history for order_summary, ending two minutes ago (complete minutes).
    env.exec(
        "INSERT INTO wh_metric_samples (minute, perspective_name, applied, backlog, lag_seconds) \
         SELECT date_trunc('minute', now()) - make_interval(mins => m), 'order_summary', 600, m, m * 1.5 \
         FROM generate_series(2, 11) AS m",
    )
    .await;
    let console = open_console(&env);

    for uri in ["/", "/?window=6h", "/?window=24h&refresh=off"] {
        let body = ok(get(&console, uri).await);
        assert_eq!(
            body.matches("<svg class=\"chart\"").count(),
            4,
            "{uri}: {body}"
        );
        for title in [
            "Applied events per second",
            "Backlog (work rows)",
            "Lag: oldest pending (s)",
            "Dead letters per minute",
        ] {
            assert!(body.contains(title), "{uri}: {title}");
        }
        assert!(!body.contains(" style="), "{uri}: no inline style");
        assert!(!body.contains("<script"), "{uri}");
    }
    // 600 applied per minute is 10/s; the highest backlog is 11.
    let body = ok(get(&console, "/").await);
    assert!(body.contains("last 10/s, max 10/s"), "{body}");
    assert!(body.contains("max 11 ("), "{body}");
    // The window links keep a paused refresh; the refresh links keep the window.
    let body = ok(get(&console, "/?window=6h&refresh=off").await);
    assert!(
        body.contains("href=\"/?window=24h&amp;refresh=off\""),
        "{body}"
    );
    assert!(body.contains("href=\"/?window=6h\""), "{body}");
    assert!(
        body.contains("href=\"/perspectives/order_summary\""),
        "{body}"
    );

    for uri in [
        "/?window=2h",
        "/perspectives/audit?window=%3Cb%3E",
        "/groups?window=1d",
    ] {
        let (response, body) = get(&console, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert!(
            body.contains("window must be 1h, 6h or 24h"),
            "{uri}: {body}"
        );
        assert!(!body.contains("<b>"), "{uri}: {body}");
    }

    let body = ok(get(&console, "/perspectives/order_summary").await);
    assert_eq!(body.matches("<svg class=\"chart\"").count(), 4, "{body}");
    assert!(body.contains("last 10/s"), "{body}");
    let body = ok(get(&console, "/perspectives/audit?window=24h").await);
    // audit has no samples: its rate says so, its dead letters arrived just now.
    assert!(body.contains("no data in this window"), "{body}");

    // A perspective named with HTML characters is escaped on its page.
    let evil = "<img src=x onerror=alert(1)>&\"";
    env.store
        .register_perspective(evil, &["OrderPlaced".to_string()])
        .await
        .unwrap();
    let path = format!(
        "/perspectives/{}",
        url::form_urlencoded::byte_serialize(evil.as_bytes())
            .collect::<String>()
            .replace('+', "%20")
    );
    let body = ok(get(&console, &path).await);
    assert!(!body.contains("<img"), "{body}");
    assert!(
        body.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{body}"
    );
    let body = ok(get(&console, "/").await);
    assert!(!body.contains("<img"), "{body}");
    let (response, body) = get(&console, "/perspectives/no_such_one").await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert!(body.contains("no_such_one"), "{body}");

    // Each group has a sparkline of its arrivals in the window (the current minute included).
    let body = ok(get(&console, "/groups").await);
    assert_eq!(
        body.matches("<svg class=\"sparkline\"").count(),
        4,
        "{body}"
    );
    assert!(body.contains("1 arrived in the last hour"), "{body}");
    let body = ok(get(&console, "/groups?window=24h&perspective=audit").await);
    assert_eq!(
        body.matches("<svg class=\"sparkline\"").count(),
        2,
        "{body}"
    );
    assert!(
        body.contains("href=\"/groups?perspective=audit\""),
        "{body}"
    );
}
