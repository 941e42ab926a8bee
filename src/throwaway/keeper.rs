//! Spawning from a thread that never exits.

use std::io;
use std::process::{Child, Command};
use std::sync::{mpsc, OnceLock};
use std::thread;

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawn `cmd` from a dedicated thread that lives until the process exits. PR_SET_PDEATHSIG
/// fires when the *thread* that forked the child exits, so spawning from a short-lived thread
/// (a test thread, a blocking-pool thread) would kill the server as soon as that thread ends.
pub(super) fn spawn_from_keeper_thread(cmd: Command) -> io::Result<Child> {
    static KEEPER: OnceLock<io::Result<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let sender = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        thread::Builder::new()
            .name("vantage-pg-keeper".into())
            .spawn(move || {
                // The sender lives in a static, so this loop only ends with the process.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map(|_| tx)
    });
    let sender = sender
        .as_ref()
        .map_err(|e| io::Error::new(e.kind(), format!("starting the spawner thread: {e}")))?;
    let (reply_tx, reply_rx) = mpsc::channel();
    sender
        .send((cmd, reply_tx))
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("the spawner thread is gone"))?
}
