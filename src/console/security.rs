//! The headers every console response carries, and the cross-site check of every POST.
//!
//! - `Content-Security-Policy`: nothing but the console's own stylesheet may load (no script
//!   at all, no inline style, no frames, forms post only to the console);
//! - `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer` (URLs carry filters),
//!   `X-Frame-Options: DENY` (with `frame-ancestors 'none'`), `Cross-Origin-Opener-Policy` and
//!   `Cross-Origin-Resource-Policy: same-origin`, and `Cache-Control: no-store` unless a route
//!   set its own (dead letters are not for shared caches);
//! - no CORS headers, ever: another origin's script cannot read a page.
//!
//! CSRF: a request with an unsafe method (anything but GET, HEAD, OPTIONS) is refused with 403
//! when the browser says it is cross-site: `Sec-Fetch-Site` other than `same-origin` or
//! `none`, or, from browsers that do not send that, an `Origin` that is not this host. A request
//! with neither header comes from a non-browser client, which cannot be a forged request from
//! a page, and passes (the rule of Go's `net/http.CrossOriginProtection`).

use axum::extract::Request;
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower_http::set_header::SetResponseHeaderLayer;

/// The console's Content-Security-Policy.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The fixed headers of every response, name and value.
pub const SECURITY_HEADERS: &[(&str, &str)] = &[
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
];

/// Wraps every route (the fallback and the 401s of authentication included) in the headers.
pub fn headers(router: Router) -> Router {
    let mut router = router.layer(SetResponseHeaderLayer::if_not_present(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    ));
    for (name, value) in SECURITY_HEADERS {
        router = router.layer(SetResponseHeaderLayer::overriding(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        ));
    }
    router
}

/// Whether a `Host` header names this machine by a loopback name: `localhost`, `127.x.x.x` or
/// `[::1]`, with or without a port. An open console (no credentials configured, so on a
/// loopback address) answers only to these, so a page whose DNS name was rebound to 127.0.0.1
/// cannot read it from the victim's browser (DNS rebinding).
pub fn loopback_host(host: &[u8]) -> bool {
    let Ok(host) = std::str::from_utf8(host) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((ip, rest)) if rest.is_empty() || rest.starts_with(':') => ip,
            _ => return false,
        },
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Why a request is cross-site, if it is.
pub fn cross_site(method: &Method, headers: &axum::http::HeaderMap) -> Option<&'static str> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.as_bytes() {
            b"same-origin" | b"none" => None,
            _ => Some("Sec-Fetch-Site says the request comes from another site"),
        };
    }
    // Neither header: not a browser, so not a forged request (passes).
    let origin = headers.get(header::ORIGIN)?;
    let host = headers.get(header::HOST).map(HeaderValue::as_bytes);
    let origin_host = origin.to_str().ok().and_then(|o| {
        o.strip_prefix("http://")
            .or_else(|| o.strip_prefix("https://"))
    });
    match (origin_host, host) {
        (Some(o), Some(h)) if o.as_bytes().eq_ignore_ascii_case(h) => None,
        _ => Some("its Origin is not this console"),
    }
}

/// The middleware: 403 for a cross-site request with an unsafe method.
pub async fn reject_cross_site(request: Request, next: Next) -> Response {
    match cross_site(request.method(), request.headers()) {
        None => next.run(request).await,
        Some(why) => {
            tracing::warn!(method = %request.method(), path = request.uri().path(), why, "console: cross-site request refused");
            (
                StatusCode::FORBIDDEN,
                super::error::page(
                    StatusCode::FORBIDDEN,
                    "Cross-site request refused",
                    &format!(
                        "This request was refused because {why}. Use the console's own pages."
                    ),
                ),
            )
                .into_response()
        }
    }
}

/// Longest value of one query or form parameter: 4 KiB. Filters, names and fingerprints are far
/// shorter; the console echoes parameters into links and redirects (`Location`), which must not
/// grow with what a client sends.
pub const MAX_PARAMETER: usize = 4 * 1024;

/// The first parameter of a query string or form body that the console refuses, and why: its
/// decoded name or value holds a NUL byte (PostgreSQL text cannot: every query would fail), or
/// it is longer than [`MAX_PARAMETER`].
fn bad_parameter(encoded: &[u8]) -> Option<String> {
    url::form_urlencoded::parse(encoded).find_map(|(k, v)| {
        let name = || {
            crate::text::one_line(&crate::text::cap_at(&k.replace('\0', "\\0"), 64)).into_owned()
        };
        if k.contains('\0') || v.contains('\0') {
            Some(format!(
                "{} holds a NUL byte, which no filter can match.",
                name()
            ))
        } else if k.len() > MAX_PARAMETER || v.len() > MAX_PARAMETER {
            Some(format!(
                "{} is longer than {} KiB: no filter or name is that long.",
                name(),
                MAX_PARAMETER / 1024
            ))
        } else {
            None
        }
    })
}

fn bad_request(message: String) -> Response {
    super::error::PageError::BadRequest(message).into_response()
}

/// The middleware: 400 naming the parameter for a NUL byte in the path, the query or a form
/// body, and for a parameter longer than [`MAX_PARAMETER`] (so no redirect echoes unbounded
/// input). The database would refuse such text, and the console would have answered 503 "try
/// again" for a request no retry can help.
pub async fn reject_nul(request: Request, next: Next) -> Response {
    // A URI cannot hold a raw NUL: only its percent-encoding, `%00`.
    let path_has_nul = request.uri().path().contains("%00");
    if request.uri().path().len() > MAX_PARAMETER {
        return bad_request(format!(
            "The path is longer than {} KiB: no dead letter, perspective or page is named so.",
            MAX_PARAMETER / 1024
        ));
    }
    if path_has_nul {
        return bad_request(
            "The path holds a NUL byte: no dead letter, perspective or page is named so."
                .to_owned(),
        );
    }
    if let Some(why) = request
        .uri()
        .query()
        .and_then(|q| bad_parameter(q.as_bytes()))
    {
        return bad_request(why);
    }
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, crate::telemetry::http::MAX_REQUEST_BODY).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n").into_response()
        }
    };
    if let Some(why) = bad_parameter(&bytes) {
        return bad_request(why);
    }
    next.run(Request::from_parts(parts, bytes.into())).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    fn h(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_static(v));
        }
        m
    }

    #[test]
    fn loopback_hosts() {
        for ok in [
            "localhost",
            "localhost:9465",
            "127.0.0.1:9465",
            "127.1.2.3",
            "[::1]:9465",
            "[::1]",
        ] {
            assert!(loopback_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "evil.example:9465",
            "localhost.evil.example",
            "10.0.0.1:9465",
            "[::2]:1",
            "[::1]x",
        ] {
            assert!(!loopback_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn safe_methods_always_pass() {
        let cross = h(&[("sec-fetch-site", "cross-site"), ("origin", "http://evil")]);
        assert_eq!(cross_site(&Method::GET, &cross), None);
        assert_eq!(cross_site(&Method::HEAD, &cross), None);
    }

    #[test]
    fn posts_must_be_same_origin() {
        let post = Method::POST;
        assert_eq!(
            cross_site(&post, &h(&[("sec-fetch-site", "same-origin")])),
            None
        );
        assert!(cross_site(&post, &h(&[("sec-fetch-site", "same-site")])).is_some());
        assert!(cross_site(&post, &h(&[("sec-fetch-site", "cross-site")])).is_some());
        let same = h(&[
            ("origin", "http://127.0.0.1:9465"),
            ("host", "127.0.0.1:9465"),
        ]);
        assert_eq!(cross_site(&post, &same), None);
        let other = h(&[
            ("origin", "http://evil.example"),
            ("host", "127.0.0.1:9465"),
        ]);
        assert!(cross_site(&post, &other).is_some());
        assert!(cross_site(&post, &h(&[("origin", "null"), ("host", "x")])).is_some());
        // curl and scripts send neither header.
        assert_eq!(cross_site(&post, &h(&[("host", "127.0.0.1:9465")])), None);
    }
}
