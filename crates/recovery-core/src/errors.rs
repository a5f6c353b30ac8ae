//! Error types shared with collectors' exit-code contract.

/// Saved partial results are valid, but the evaluation still has unfinished work.
///
/// `exit_code = (75 if made_progress else 1) if retryable else 76`, as in the Python module:
/// 75 asks the scheduler to run again, 1 is an ordinary failure (no progress to build on),
/// 76 says retrying cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct IncompleteEvaluationError {
    pub message: String,
    pub retryable: bool,
    pub made_progress: bool,
    pub failure_kind: Option<String>,
}

impl IncompleteEvaluationError {
    /// Exit code for a partial evaluation that made progress and may be retried.
    pub const EXIT_PARTIAL: i32 = 75;
    /// Exit code for a retryable stop without progress.
    pub const EXIT_NO_PROGRESS: i32 = 1;
    /// Exit code when retrying cannot complete the evaluation.
    pub const EXIT_NOT_RETRYABLE: i32 = 76;

    /// The Python constructor's defaults: retryable, made progress, no kind.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            retryable: true,
            made_progress: true,
            failure_kind: None,
        }
    }

    pub fn exit_code(&self) -> i32 {
        match (self.retryable, self.made_progress) {
            (false, _) => Self::EXIT_NOT_RETRYABLE,
            (true, true) => Self::EXIT_PARTIAL,
            (true, false) => Self::EXIT_NO_PROGRESS,
        }
    }
}
