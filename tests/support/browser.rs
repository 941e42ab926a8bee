//! The browser harness of the console's browser tests (`tests/console/browser.rs`): Debian's `chromium` driven through
//! `chromedriver` (WebDriver, via fantoccini), headless, against a console served in-process.
//!
//! - chromedriver is started by the harness on a free port, one per test, with a profile
//!   directory of its own; nothing is installed at test time. When either program is missing
//!   the test fails saying what to install (`apt-get install chromium chromium-driver`, which
//!   `.ci/run` does).
//! - [`with_browser`] runs a test body and then always closes the browser session and stops
//!   chromedriver, also when the body panics (`catch_unwind`), then re-raises the panic; the
//!   [`Driver`]'s `Drop` kills what is left (chromedriver by its pid, and the browser processes
//!   of this profile directory by theirs) should even that not run.
//! - The browser's console log is recorded (`goog:loggingPrefs`), so a test can assert that no
//!   page violated the Content-Security-Policy ([`Browser::csp_violations`]).

use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use futures::FutureExt as _;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use vantage::config::Settings;
use vantage::internals::console::{self, ConsoleState};
use vantage::internals::store::StoreInternals as _;
use vantage::store::Store;

/// The window every page is looked at in.
pub const WINDOW: (u32, u32) = (1280, 800);

const INSTALL: &str = "The console's browser tests need Debian's chromium and chromedriver: \
     apt-get install chromium chromium-driver (.ci/run installs them).";

/// `name` on the PATH or at one of `fallbacks`.
fn find_program(name: &str, fallbacks: &[&str]) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| fallbacks.iter().map(PathBuf::from).find(|p| p.is_file()))
}

/// A running chromedriver, killed on drop with the browsers of its profile.
pub struct Driver {
    child: Child,
    port: u16,
    profile: tempfile::TempDir,
}

impl Driver {
    /// Starts chromedriver on a free loopback port and waits until it answers.
    pub async fn start() -> Driver {
        let driver = find_program("chromedriver", &["/usr/bin/chromedriver"])
            .unwrap_or_else(|| panic!("chromedriver not found. {INSTALL}"));
        if chromium().is_none() {
            panic!("chromium not found. {INSTALL}");
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(&driver)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}. {INSTALL}", driver.display()));
        let me = Driver {
            child,
            port,
            profile: tempfile::tempdir().expect("a profile directory"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on port {port} within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        me
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Opens a headless browser session.
    async fn connect(&self) -> Client {
        let binary = chromium().expect("checked at start");
        let caps = json!({
            "goog:chromeOptions": {
                "binary": binary,
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--disable-extensions",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--hide-scrollbars",
                    format!("--window-size={},{}", WINDOW.0, WINDOW.1),
                    format!("--user-data-dir={}", self.profile.path().display()),
                ],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        });
        let caps = match caps {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let mut builder = ClientBuilder::new(connector);
        builder.capabilities(caps);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match builder.connect(&self.url()).await {
                Ok(client) => return client,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("browser session not ready yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("cannot start a headless chromium session: {e}. {INSTALL}"),
            }
        }
    }

    /// The pids of the processes started with this driver's profile directory (the browser
    /// and its helpers).
    fn browser_pids(&self) -> Vec<i32> {
        let marker = format!("--user-data-dir={}", self.profile.path().display());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&marker))
                    .unwrap_or(false)
            })
            .collect()
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in self.browser_pids() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

fn chromium() -> Option<PathBuf> {
    // Debian's /usr/bin/chromium is a wrapper script; the browser itself is beside it.
    ["/usr/lib/chromium/chromium"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .or_else(|| find_program("chromium", &[]))
}

/// A console served in-process on a free loopback port until dropped.
pub struct Served {
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl Served {
    /// Serves the console over `store` with `settings`.
    pub async fn start(store: &Store, settings: &Settings) -> Served {
        let (listener, addr) = console::bind("127.0.0.1:0".parse().unwrap())
            .await
            .expect("bind the console");
        let state = ConsoleState::new(
            store.with_statement_timeout(console::STATEMENT_TIMEOUT),
            settings,
        );
        let stop = CancellationToken::new();
        tokio::spawn(console::serve(listener, state, stop.clone()));
        Served { addr, stop }
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A browser session.
pub struct Browser {
    pub client: Client,
}

/// `POST /session/{id}/se/log {"type": "browser"}`: chromedriver's log of the browser
/// console since the last call.
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!("session/{}/se/log", session_id.unwrap_or("")))
    }

    fn method_and_body(&self, _: &url::Url) -> (axum::http::Method, Option<String>) {
        (
            axum::http::Method::POST,
            Some(json!({"type": "browser"}).to_string()),
        )
    }
}

impl Browser {
    /// Opens `url` and waits for the page.
    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    /// The text of the page's `<body>` as a person sees it.
    pub async fn text(&self) -> String {
        self.client
            .find(Locator::Css("body"))
            .await
            .expect("a body")
            .text()
            .await
            .expect("its text")
    }

    /// The path and query of the current page.
    pub async fn path(&self) -> String {
        let url = self.client.current_url().await.expect("a current URL");
        match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        }
    }

    /// Clicks what `css` finds, a link or a form's button, and waits until the page it leads
    /// to has loaded (the old document is marked first, so even a page at the same URL counts).
    pub async fn click(&self, css: &str) {
        let element = match self.client.find(Locator::Css(css)).await {
            Ok(element) => element,
            Err(e) => panic!("nothing matches {css:?} on {}: {e}", self.path().await),
        };
        // WebDriver's scripts are not the page's: the Content-Security-Policy does not apply.
        self.client
            .execute("window.__vantageOld = true;", vec![])
            .await
            .expect("mark the page");
        element
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css:?}: {e}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let loaded = self
                .client
                .execute(
                    "return !window.__vantageOld && document.readyState === 'complete';",
                    vec![],
                )
                .await;
            if matches!(loaded, Ok(Value::Bool(true))) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "clicking {css:?} led to no new page within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Whether anything matches `css`.
    pub async fn has(&self, css: &str) -> bool {
        !self
            .client
            .find_all(Locator::Css(css))
            .await
            .expect("find")
            .is_empty()
    }

    /// Every entry of the browser's console log since the last call.
    pub async fn log(&self) -> Vec<Value> {
        match self.client.issue_cmd(BrowserLog).await {
            Ok(Value::Array(entries)) => entries,
            Ok(other) => panic!("unexpected browser log: {other}"),
            Err(e) => panic!("cannot read the browser log: {e}"),
        }
    }

    /// The console-log messages since the last call that report a Content-Security-Policy
    /// violation.
    pub async fn csp_violations(&self) -> Vec<String> {
        self.log()
            .await
            .into_iter()
            .filter_map(|e| e.get("message").and_then(Value::as_str).map(str::to_owned))
            .filter(|m| m.contains("Content Security Policy"))
            .collect()
    }

    /// Sizes the window so that the page itself (the viewport) is [`WINDOW`]: the window's
    /// frame (whatever it is in this browser) is measured and added.
    async fn fit_viewport(&self) {
        let viewport = || async {
            let size = self
                .client
                .execute("return [window.innerWidth, window.innerHeight];", vec![])
                .await
                .expect("the viewport's size");
            let at = |i: usize| size[i].as_u64().unwrap_or(0) as u32;
            (at(0), at(1))
        };
        let (width, height) = self.client.get_window_size().await.expect("window size");
        let (inner_width, inner_height) = viewport().await;
        let frame = (
            (width as u32).saturating_sub(inner_width),
            (height as u32).saturating_sub(inner_height),
        );
        self.client
            .set_window_size(WINDOW.0 + frame.0, WINDOW.1 + frame.1)
            .await
            .expect("resize the window");
        assert_eq!(viewport().await, WINDOW, "the viewport after resizing");
    }

    /// Saves a PNG of the window at `path`.
    pub async fn screenshot(&self, path: &Path) {
        let png = self.client.screenshot().await.expect("a screenshot");
        std::fs::write(path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}

/// Runs `body` with a fresh headless browser, then closes it and stops chromedriver whether
/// `body` returned or panicked; a panic is re-raised after the cleanup.
pub async fn with_browser<F, Fut>(body: F)
where
    F: FnOnce(Browser) -> Fut,
    Fut: Future<Output = ()>,
{
    let driver = Driver::start().await;
    let client = driver.connect().await;
    let for_cleanup = client.clone();
    let browser = Browser { client };
    let outcome = AssertUnwindSafe(async move {
        browser.fit_viewport().await;
        body(browser).await
    })
    .catch_unwind()
    .await;
    // Close the session (the browser exits) even when the body failed.
    let _ = tokio::time::timeout(Duration::from_secs(10), for_cleanup.close()).await;
    drop(driver);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
