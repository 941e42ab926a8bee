use stateright::{Checker, Model};

use super::{Backfill, BackfillBug};

/// Every interleaving of batches, diverts, failures and lane heads keeps every property.
#[test]
fn the_backfill_keeps_stream_order_and_loses_nothing_in_every_run() {
    let checker = Backfill { bug: None }.checker().spawn_bfs().join();
    checker.assert_properties();
    assert!(checker.is_done());
    eprintln!(
        "backfill: {} states, every one checked",
        checker.unique_state_count()
    );
    assert!(
        checker.unique_state_count() > 100,
        "the model explores {} states: too few to mean much",
        checker.unique_state_count()
    );
}

/// Each mistake is found by the property it breaks, with a counterexample.
#[test]
fn the_checker_finds_each_backfill_mistake() {
    for (bug, property) in [
        (BackfillBug::DirectBehindDiverted, "applied in stream order"),
        (
            BackfillBug::SkipFailedBatch,
            "done means every event accounted for",
        ),
    ] {
        let checker = Backfill { bug: Some(bug) }.checker().spawn_bfs().join();
        let Some(path) = checker.discovery(property) else {
            panic!("{bug:?}: the checker did not find a violation of {property:?}");
        };
        let last = path.last_state().clone();
        let actions = path.into_actions();
        assert!(!actions.is_empty(), "{bug:?}: an empty counterexample");
        eprintln!("{bug:?} breaks {property:?}:\n  {actions:?}\n  ending in {last:?}");
    }
}
