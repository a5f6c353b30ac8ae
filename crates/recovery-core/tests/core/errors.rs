//! `IncompleteEvaluationError`: the exit-code contract.

use recovery_core::errors::IncompleteEvaluationError;

#[test]
fn exit_codes_follow_retryable_and_made_progress() {
    for (retryable, made_progress, expected) in [
        (true, true, 75),
        (true, false, 1),
        (false, true, 76),
        (false, false, 76),
    ] {
        let error = IncompleteEvaluationError {
            message: "2/3 samples completed".into(),
            retryable,
            made_progress,
            failure_kind: None,
        };
        assert_eq!(
            error.exit_code(),
            expected,
            "retryable={retryable} made_progress={made_progress}"
        );
    }
    let defaults = IncompleteEvaluationError::new("partial");
    assert_eq!(
        (
            defaults.retryable,
            defaults.made_progress,
            defaults.exit_code()
        ),
        (true, true, 75)
    );
    assert_eq!(defaults.to_string(), "partial");
}
