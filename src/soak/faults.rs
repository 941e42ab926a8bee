//! What each phase does during its fault window. Every fault ends by the deadline it is given
//! and undoes itself (rate and poison share restored, the proxy open, held sessions closed);
//! what it did and what went wrong are returned for the report.

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::store::soak::HeldSession;

use super::{fleet, Phase, Soak, POISONED, REBUILT};

/// What a fault did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Outcome {
    /// What it did, for the report.
    pub notes: Vec<String>,
    /// What it could not do (a failed operator command, a restart that failed).
    pub errors: Vec<String>,
}

impl Outcome {
    fn note(&mut self, line: impl Into<String>) {
        self.notes.push(line.into());
    }

    fn error(&mut self, line: impl Into<String>) {
        self.errors.push(line.into());
    }
}

/// Sleeps until `until` (a scripted duration, not a guess at some state).
async fn until(deadline: Instant) {
    tokio::time::sleep_until(deadline.into()).await;
}

/// Runs `phase`'s fault until `deadline`.
pub async fn run(soak: &Soak, phase: Phase, deadline: Instant) -> Outcome {
    let mut out = Outcome::default();
    match phase {
        Phase::Steady => until(deadline).await,
        Phase::Load => {
            let rate = soak.config.rate;
            soak.knobs.rate.store(rate * 3 / 2, Ordering::SeqCst);
            out.note(format!("{} events/s", rate * 3 / 2));
            until(deadline).await;
            soak.knobs.rate.store(rate, Ordering::SeqCst);
        }
        Phase::Sigkill => sigkill(soak, deadline, &mut out).await,
        Phase::PgRestart => pg_restart(soak, deadline, &mut out).await,
        Phase::Terminate => terminate(soak, deadline, &mut out).await,
        Phase::Blackhole => {
            soak.proxy.blackhole(true);
            out.note("the daemons' proxy forwarded nothing");
            until(deadline).await;
            soak.proxy.blackhole(false);
        }
        Phase::IdleXact => hold(soak, deadline, 1, Hold::Xid, &mut out).await,
        Phase::RrReaders => hold(soak, deadline, 4, Hold::Snapshot, &mut out).await,
        Phase::IdleConns => idle_connections(soak, deadline, &mut out).await,
        Phase::PoisonBurst => {
            soak.knobs
                .poison_ppm
                .store(soak.config.burst_ppm, Ordering::SeqCst);
            out.note(format!(
                "{} poison events per million",
                soak.config.burst_ppm
            ));
            until(deadline).await;
            soak.knobs
                .poison_ppm
                .store(soak.config.poison_ppm, Ordering::SeqCst);
        }
        Phase::Operator => operator(soak, deadline, &mut out).await,
    }
    for e in &out.errors {
        soak.say(&format!("{}: {e}", phase.name()));
    }
    out
}

/// SIGKILLs daemon 0 every `kill_every`, replaced at once; the other daemons live through the
/// whole run, so their memory, descriptors and connections are measured over all of it.
async fn sigkill(soak: &Soak, deadline: Instant, out: &mut Outcome) {
    let mut kills = 0;
    while Instant::now() < deadline {
        match soak.fleet.lock().await.kill_and_replace(0).await {
            Ok(_) => kills += 1,
            Err(e) => out.error(format!("replacing daemon 0: {e}")),
        }
        let next = Instant::now() + soak.config.kill_every;
        until(next.min(deadline)).await;
    }
    out.note(format!(
        "{kills} SIGKILLs of daemon 0, each replaced at once"
    ));
}

async fn pg_restart(soak: &Soak, deadline: Instant, out: &mut Outcome) {
    let Some(server) = soak.server.clone() else {
        out.note("skipped: only a throwaway server started by the soak is restarted");
        until(deadline).await;
        return;
    };
    let mut restarts = 0;
    while Instant::now() < deadline {
        let s = server.clone();
        let took = Instant::now();
        match tokio::task::spawn_blocking(move || s.restart()).await {
            Ok(Ok(())) => {
                restarts += 1;
                out.note(format!(
                    "restart {restarts} (fast shutdown) took {:.1} s",
                    took.elapsed().as_secs_f64()
                ));
            }
            Ok(Err(e)) => out.error(format!("restarting PostgreSQL: {e}")),
            Err(e) => out.error(format!("restarting PostgreSQL: {e}")),
        }
        let next = took + soak.config.restart_every;
        until(next.min(deadline)).await;
    }
}

async fn terminate(soak: &Soak, deadline: Instant, out: &mut Outcome) {
    let mut rounds = 0;
    let mut terminated = 0;
    while Instant::now() < deadline {
        if let Ok(n) = soak.db.terminate_daemon_backends().await {
            terminated += n;
        }
        rounds += 1;
        until((Instant::now() + Duration::from_millis(500)).min(deadline)).await;
    }
    out.note(format!(
        "{terminated} daemon sessions terminated in {rounds} rounds"
    ));
}

enum Hold {
    Xid,
    Snapshot,
}

async fn hold(soak: &Soak, deadline: Instant, n: usize, what: Hold, out: &mut Outcome) {
    let mut held = Vec::new();
    for _ in 0..n {
        let session = async {
            let mut s = HeldSession::open(&soak.session_options).await?;
            match what {
                Hold::Xid => s.hold_xid().await?,
                Hold::Snapshot => s.hold_snapshot().await?,
            }
            Ok::<_, crate::store::StoreError>(s)
        };
        match session.await {
            Ok(s) => held.push(s),
            Err(e) => out.error(format!("opening a held session: {e}")),
        }
    }
    out.note(match what {
        Hold::Xid => format!(
            "{} session(s) idle in transaction holding an xid",
            held.len()
        ),
        Hold::Snapshot => format!(
            "{} REPEATABLE READ reader(s) holding their snapshot",
            held.len()
        ),
    });
    until(deadline).await;
    for s in held {
        s.close().await;
    }
}

/// Opens `idle_connections` idle sessions, or as many as the server has room for beside the
/// daemons (keeping a few for them to reconnect with). They are opened `OPENING_AT_ONCE` at a
/// time: one after another, 300 took longer than the short profile's 6.6-second fault on a
/// loaded machine, and the fault held fewer connections than it scripts.
async fn idle_connections(soak: &Soak, deadline: Instant, out: &mut Outcome) {
    use futures::stream::{self, StreamExt};
    const LEFT_FOR_DAEMONS: u64 = 10;
    const OPENING_AT_ONCE: usize = 16;
    let wanted = soak.config.idle_connections as u64;
    let room = match soak.db.connection_room().await {
        Ok((max, open)) => max.saturating_sub(open + LEFT_FOR_DAEMONS),
        Err(e) => {
            out.error(format!("reading max_connections: {e}"));
            0
        }
    };
    let n = wanted.min(room);
    let mut held = Vec::new();
    let mut cut_by_deadline = false;
    {
        let mut opening = stream::iter(0..n)
            .map(|_| HeldSession::open(&soak.session_options))
            .buffer_unordered(OPENING_AT_ONCE);
        loop {
            tokio::select! {
                next = opening.next() => match next {
                    Some(Ok(s)) => held.push(s),
                    Some(Err(e)) => {
                        out.error(format!("opening idle connection {}: {e}", held.len() + 1));
                        break;
                    }
                    None => break,
                },
                _ = until(deadline) => {
                    cut_by_deadline = true;
                    break;
                }
            }
        }
        // Dropping the stream abandons the sessions still connecting.
    }
    out.note(format!("{} idle connections held", held.len()));
    if (held.len() as u64) < wanted {
        out.note(if cut_by_deadline {
            format!(
                "fewer than the {wanted} asked: the fault's window ended while they were opening"
            )
        } else {
            format!(
                "fewer than the {wanted} asked: the server has room for {room} beside the daemons"
            )
        });
    }
    until(deadline).await;
    for s in held {
        s.close().await;
    }
}

/// Cures half of the poisoned perspective's dead letters, requeues all of them with
/// `vantage dlq requeue --all`, and rebuilds the rebuilt perspective with
/// `vantage perspectives rebuild`, as an operator would, mid-run.
async fn operator(soak: &Soak, deadline: Instant, out: &mut Outcome) {
    // A poison event takes max + 1 claims and their backoffs to be dead-lettered: on a slow
    // machine a short run can reach this phase before two are, and then there is nothing to
    // cure. Wait for them (for at most half the fault), as an operator paged for them would.
    let wait_until = Instant::now() + deadline.saturating_duration_since(Instant::now()) / 2;
    loop {
        match soak.db.open_dead_letters(POISONED).await {
            Ok(n) if n >= 2 || Instant::now() >= wait_until => {
                out.note(format!("{n} open dead letters of {POISONED}"));
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => {
                out.error(format!("counting dead letters: {e}"));
                break;
            }
        }
    }
    match soak.db.cure_half(POISONED).await {
        Ok(n) => out.note(format!("{n} of them cured (they must now apply)")),
        Err(e) => out.error(format!("curing dead letters: {e}")),
    }
    let requeue = [
        "dlq",
        "requeue",
        "--all",
        "--perspective",
        POISONED,
        "--yes",
    ];
    command(soak, &requeue, out).await;
    command(soak, &["perspectives", "rebuild", REBUILT, "--yes"], out).await;
    until(deadline).await;
}

/// Runs `vantage --config <operator config> ARGS`; a non-zero exit is an error of the phase.
async fn command(soak: &Soak, args: &[&str], out: &mut Outcome) {
    let mut cmd = tokio::process::Command::new(&soak.exe);
    cmd.arg("--config").arg(&soak.operator_config).args(args);
    fleet::scrub_env(&mut cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let shown = format!("vantage {}", args.join(" "));
    let took = Instant::now();
    let output = match cmd.spawn() {
        Ok(child) => tokio::time::timeout(Duration::from_secs(300), child.wait_with_output()).await,
        Err(e) => {
            out.error(format!("{shown}: could not start: {e}"));
            return;
        }
    };
    match output {
        Ok(Ok(o)) => {
            let last = |b: &[u8]| {
                let text = String::from_utf8_lossy(b);
                let line = text.lines().last().unwrap_or("");
                crate::text::one_line(&crate::text::cap_at(line, 200)).into_owned()
            };
            let line = format!(
                "{shown}: exit {} in {:.1} s: {}",
                o.status
                    .code()
                    .map_or("by signal".into(), |c| c.to_string()),
                took.elapsed().as_secs_f64(),
                last(&o.stdout)
            );
            if o.status.success() {
                out.note(line);
            } else {
                out.error(format!("{line} / {}", last(&o.stderr)));
            }
        }
        Ok(Err(e)) => out.error(format!("{shown}: {e}")),
        Err(_) => out.error(format!("{shown}: no exit within 300 s")),
    }
}
