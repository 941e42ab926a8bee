use stateright::{Checker, Model};

use super::{Bug, Protocol};

/// Every interleaving of the real protocol keeps every property; and the model is not vacuous:
/// some run applies every event, some run dead-letters one (the two `sometimes` properties).
#[test]
fn the_protocol_keeps_its_guarantees_in_every_interleaving() {
    let checker = Protocol { bug: None }.checker().spawn_bfs().join();
    checker.assert_properties();
    assert!(checker.is_done());
    eprintln!("{} states, every one checked", checker.unique_state_count());
    assert!(
        checker.unique_state_count() > 1_000,
        "the model explores {} states: too few to mean much",
        checker.unique_state_count()
    );
}

/// Each re-introduced bug is found by the property it breaks, with a counterexample (printed
/// with `--nocapture`). The search is bounded in depth so the trace stays readable.
#[test]
fn the_checker_finds_each_bug_the_protocol_guards_against() {
    for (bug, property) in [
        (Bug::TakeoverOfLiveOwner, "one live holder per lane"),
        (
            Bug::FirstUnleasedRowInsteadOfHead,
            "applied in stream order",
        ),
        (Bug::UnfencedCompletion, "applied at most once"),
        (Bug::LostClaimLeftToLapse, "nothing stranded"),
    ] {
        let checker = Protocol { bug: Some(bug) }
            .checker()
            .target_max_depth(9)
            .spawn_bfs()
            .join();
        let Some(path) = checker.discovery(property) else {
            panic!("{bug:?}: the checker did not find a violation of {property:?}");
        };
        let last = path.last_state().clone();
        let actions = path.into_actions();
        assert!(!actions.is_empty(), "{bug:?}: an empty counterexample");
        eprintln!("{bug:?} breaks {property:?}:\n  {actions:?}\n  ending in {last:?}");
    }
}
