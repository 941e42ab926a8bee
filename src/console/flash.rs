//! What an action tells the operator on the page it redirects to (POST → 303 → GET).
//!
//! The message stays on the server: the redirect carries only `?flash=ID`, a random id, so a
//! link made by someone else cannot put words on the console's pages. Messages are kept for
//! [`FLASH_TTL`], at most [`FLASH_CAPACITY`] of them (the oldest go first); a page whose flash
//! has gone (expired, or another console process behind the same address) simply shows none —
//! what was done is in the history and the audit log either way.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// How long a message can be shown.
pub const FLASH_TTL: Duration = Duration::from_secs(10 * 60);

/// Most messages kept.
pub const FLASH_CAPACITY: usize = 256;

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flash {
    /// Whether it reports something done (`true`) or refused / failed.
    pub ok: bool,
    /// What to say.
    pub text: String,
}

impl Flash {
    /// Something was done.
    pub fn done(text: impl Into<String>) -> Self {
        Flash {
            ok: true,
            text: text.into(),
        }
    }

    /// Something was refused or failed.
    pub fn refused(text: impl Into<String>) -> Self {
        Flash {
            ok: false,
            text: text.into(),
        }
    }
}

/// The messages of one console process.
#[derive(Debug, Default)]
pub struct Flashes {
    kept: Mutex<VecDeque<(Uuid, Instant, Flash)>>,
}

impl Flashes {
    /// Keeps `flash`; returns its id for the redirect.
    pub fn put(&self, flash: Flash) -> Uuid {
        let id = Uuid::new_v4();
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.retain(|(_, at, _)| now.duration_since(*at) < FLASH_TTL);
        while kept.len() >= FLASH_CAPACITY {
            kept.pop_front();
        }
        kept.push_back((id, now, flash));
        id
    }

    /// The message `id` names, if it is still kept. Reading does not remove it: a reload shows
    /// the same page.
    pub fn get(&self, id: &str) -> Option<Flash> {
        let id = Uuid::parse_str(id).ok()?;
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.iter()
            .find(|(k, at, _)| *k == id && at.elapsed() < FLASH_TTL)
            .map(|(_, _, f)| f.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_by_id_and_bounded() {
        let f = Flashes::default();
        let id = f.put(Flash::done("Purged position 4."));
        assert_eq!(
            f.get(&id.to_string()),
            Some(Flash::done("Purged position 4."))
        );
        assert_eq!(f.get(&Uuid::new_v4().to_string()), None);
        assert_eq!(f.get("not-an-id"), None);
        for i in 0..FLASH_CAPACITY {
            f.put(Flash::refused(format!("{i}")));
        }
        assert_eq!(f.get(&id.to_string()), None, "the oldest went first");
    }
}
