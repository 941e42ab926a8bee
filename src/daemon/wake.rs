//! How the work listener wakes the consumer loops of one process: one idle loop per
//! notification, not all of them.
//!
//! Every loop that claims for every perspective waits in one pool, and a notification wakes one
//! of them. Each notification used to wake every loop (four per process by default): at 1 000
//! events/s, appended in 20 commits a second, three daemons made 290 claims a second of which
//! 38 found work, and the claims took 775 ms of server time a second, of 955 ms in all of
//! vantage's functions (`pg_stat_user_functions` beside a 60-minute soak; 126 claims and 341 ms
//! since, RELIABILITY.md, seventeenth run). More loops join only when work is plentiful: a
//! loop whose claim came back full relays the wake-up to the next idle one (the pipeline's
//! `relay`), so a backlog still has every loop claiming within a few claims.
//!
//! A notification is never lost: one that arrives while every loop is busy is kept (one
//! permit, [`Notify`]'s), and the next loop to wait claims at once. A loop
//! whose claims ask only for a part of the perspectives (while some perspective replays its
//! history, `pipeline::replaying`) is woken by every notification instead, as before: work of
//! the other part must not wait for it. Neither primitive queues a waiter per iteration (a
//! dropped [`Notify::notified`] future leaves the queue, and one woken but dropped passes its
//! wake-up on), so a long-running loop leaks nothing.

use std::sync::Arc;

use tokio::sync::{watch, Notify};

/// The wake-ups of one process, shared by its listener and its consumer loops.
#[derive(Debug)]
pub struct Wake {
    /// Wakes one idle loop of those that claim for every perspective.
    one: Arc<Notify>,
    /// Counts notifications, for the loops that claim for a part (each wakes on every one).
    all: watch::Sender<u64>,
}

impl Wake {
    /// A fresh set of wake-ups.
    pub fn new() -> Arc<Wake> {
        Arc::new(Wake {
            one: Arc::new(Notify::new()),
            all: watch::channel(0).0,
        })
    }

    /// Work may have arrived (a notification, or a reconnected listener): wake one idle loop of
    /// the pool, or the next to wait if none is idle, and every loop that claims for a part.
    pub fn work_arrived(&self) {
        self.one.notify_one();
        self.all.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// What a loop whose claim came back full pokes so that one more idle loop claims beside it.
    pub fn relay(&self) -> Arc<Notify> {
        Arc::clone(&self.one)
    }

    /// A consumer loop's side.
    pub fn waiter(self: &Arc<Wake>) -> Waiter {
        Waiter {
            seen: self.all.subscribe(),
            wake: Arc::clone(self),
        }
    }
}

/// One consumer loop's view of [`Wake`].
#[derive(Debug)]
pub struct Waiter {
    seen: watch::Receiver<u64>,
    // Keeps the sender alive: `changed` on a closed channel would return at once, forever.
    wake: Arc<Wake>,
}

impl Waiter {
    /// Marks every notification so far as seen; called before a claim, so that one arriving
    /// during the claim wakes the next wait at once (for a loop that claims for a part; the
    /// pool keeps its permit by itself).
    pub fn before_claim(&mut self) {
        self.seen.borrow_and_update();
    }

    /// Waits for work: in the pool (one loop per notification) when the loop claims for every
    /// perspective, else for the next notification, whichever loop it wakes too.
    pub async fn wait(&mut self, claims_every_perspective: bool) {
        if claims_every_perspective {
            self.wake.one.notified().await;
        } else if self.seen.changed().await.is_err() {
            // Unreachable while `self.wake` holds the sender; never spin if it were.
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Spawns `n` loops that each wait once in the pool and count when they wake.
    fn pool_waiters(
        wake: &Arc<Wake>,
        n: usize,
    ) -> (
        Arc<std::sync::atomic::AtomicUsize>,
        Vec<tokio::task::JoinHandle<()>>,
    ) {
        let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handles = (0..n)
            .map(|_| {
                let mut w = wake.waiter();
                let woken = Arc::clone(&woken);
                tokio::spawn(async move {
                    w.wait(true).await;
                    woken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                })
            })
            .collect();
        (woken, handles)
    }

    /// Lets every spawned task run until it waits again (the paused clock advances only when
    /// every task is idle).
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_notification_wakes_one_idle_loop_of_the_pool() {
        let wake = Wake::new();
        let (woken, _handles) = pool_waiters(&wake, 4);
        settle().await;
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 0);
        wake.work_arrived();
        settle().await;
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A full claim relays: one more.
        wake.relay().notify_one();
        settle().await;
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_notification_while_every_loop_is_busy_is_kept_for_the_next_wait() {
        let wake = Wake::new();
        let mut w = wake.waiter();
        wake.work_arrived();
        wake.work_arrived();
        // Kept once (one permit), not lost: the next wait returns at once...
        tokio::time::timeout(Duration::from_secs(1), w.wait(true))
            .await
            .expect("the kept notification wakes the next wait");
        // ...and the one after waits for a new notification.
        assert!(tokio::time::timeout(Duration::from_secs(1), w.wait(true))
            .await
            .is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_claiming_for_a_part_wakes_on_every_notification_and_misses_none() {
        let wake = Wake::new();
        let mut part = wake.waiter();
        let (woken, _handles) = pool_waiters(&wake, 2);
        settle().await;
        part.before_claim();
        // Arrives during this loop's claim: its next wait returns at once.
        wake.work_arrived();
        tokio::time::timeout(Duration::from_secs(1), part.wait(false))
            .await
            .expect("a notification during the claim is not missed");
        // The pool got its one wake-up as well.
        settle().await;
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1);
        part.before_claim();
        assert!(
            tokio::time::timeout(Duration::from_secs(1), part.wait(false))
                .await
                .is_err()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_woken_wait_dropped_before_it_ran_passes_its_wake_up_on() {
        let wake = Wake::new();
        let mut first = wake.waiter();
        let (woken, _handles) = {
            // The first waiter queues before the others, so it is the one notified.
            let mut fut = Box::pin(first.wait(true));
            assert!(futures_poll_once(&mut fut).await.is_none());
            let others = pool_waiters(&wake, 1);
            settle().await;
            wake.work_arrived();
            drop(fut);
            others
        };
        settle().await;
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// Polls `fut` once; `Some` if it completed.
    async fn futures_poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *fut).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}
