//! The index of a run's saved outcomes and the plan views over it.
//!
//! Invariants:
//! - an index holds the facts of each outcome that the plan reads, never the row; the outcomes
//!   of a rollout are found from its inventory position, so adding an outcome and deciding a
//!   rollout cost the same whatever the size of the run;
//! - outcomes are checked when added (inventory, indices, run, reservation, record shape,
//!   artifact) against the manifest of that moment; a later manifest only ever reserves more,
//!   which [`RunIndex::still_valid_for`] confirms before an index is reused with it;
//! - two outcomes of one attempt are compared by their canonical payload, read back through a
//!   [`LineSource`] (rare: a retried write, a migration); identical bytes need no parse;
//! - a [`PlanView`] decides every rollout from the index, the current manifest, the cap and the
//!   approvals, allocating only for the entries it is asked to show.

use super::{
    Artifact, Budget, Coverage, IndexOptions, PlanEntry, PlanError, PlanState, ResumePlan,
    RowVerdict, classify_facts,
};
use crate::facts::{AttemptField, IdentityFacts, IndexField, OutcomeFacts};
use crate::failure::{ClassificationPolicy, FailureClass};
use crate::manifest::RunManifest;
use crate::predicates as p;
use crate::rows::{
    ROLLOUT_INDEX_KEY, TASK_INDEX_KEY, failure_record_problems, sidecar_failure_class,
};
use serde::Serialize;
use serde_json::Value;
use smallvec::SmallVec;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::OnceLock;

/// Where a line is in its file: 1-based line number, byte offset and length (newline included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineAt {
    pub line: u64,
    pub offset: u64,
    pub length: u64,
}

/// Reads back a line the index saw before, to compare two outcomes of one attempt.
pub trait LineSource {
    fn read_line(&mut self, artifact: Artifact, at: LineAt) -> Result<Vec<u8>, String>;
}

/// The saved lines, and a line about to be saved at `at` in `artifact`.
struct WithCandidate<'a> {
    artifact: Artifact,
    at: LineAt,
    line: &'a [u8],
    files: &'a mut dyn LineSource,
}

impl LineSource for WithCandidate<'_> {
    fn read_line(&mut self, artifact: Artifact, at: LineAt) -> Result<Vec<u8>, String> {
        if (artifact, at) == (self.artifact, self.at) {
            return Ok(self.line.to_vec());
        }
        self.files.read_line(artifact, at)
    }
}

/// The lines of outcome files held in memory (tests, small inputs).
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryLines<'a> {
    pub failures: &'a [u8],
    pub results: &'a [u8],
}

impl LineSource for MemoryLines<'_> {
    fn read_line(&mut self, artifact: Artifact, at: LineAt) -> Result<Vec<u8>, String> {
        let bytes = match artifact {
            Artifact::Failures => self.failures,
            Artifact::Results => self.results,
        };
        usize::try_from(at.offset)
            .ok()
            .zip(usize::try_from(at.offset + at.length).ok())
            .and_then(|(start, end)| bytes.get(start..end))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| format!("no line at byte {}", at.offset))
    }
}

/// One expected rollout of the materialized inventory.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    pub rollout_id: String,
    pub task_index: IndexField,
    pub rollout_index: IndexField,
}

impl Expected {
    /// The (task index, rollout index) an approval names, `-1` where the row has none.
    fn approval_indices(&self) -> (i64, i64) {
        (
            self.task_index.as_index().unwrap_or(-1),
            self.rollout_index.as_index().unwrap_or(-1),
        )
    }
}

/// What classification says of one outcome row (decided where the row is parsed).
#[derive(Debug, Clone)]
pub struct Classified {
    verdict: RowVerdict,
    terminal: bool,
    terminal_with_timeout_opt_in: bool,
    /// Delivery was `not_sent`: the failure never counts.
    not_sent: bool,
    observed_elapsed: Option<f64>,
    failure_kind: Option<Box<str>>,
    responsibility: FailureClass,
    masked_infrastructure_kind: Option<Box<str>>,
    masked_kept_answer_kind: Option<Box<str>>,
    masked: bool,
    has_reward: bool,
    counts_as_zero: bool,
    reuse_cached_deliverable: bool,
}

/// What the index needs of one saved outcome line: its identity, routing and record fields and
/// its classification, a few dozen bytes whatever the row's size.
#[derive(Debug, Clone)]
pub struct OutcomeRow {
    /// Evidence, not an outcome: an omitted rollout's stand-in or an unrouted run error.
    evidence: bool,
    identity: IdentityFacts,
    attempt: AttemptField,
    run_id: Option<Option<String>>,
    /// Boxed, as the two values below are: the row is kept per line until it is indexed, and
    /// these rare or short fields would otherwise widen every one.
    failure_class: Option<Box<Value>>,
    failure_record: Option<Box<Value>>,
    failure_terminal: bool,
    invalid_judge_response: bool,
    migrated_invalid_judge: bool,
    /// The SHA-256 of the saved line this outcome re-judges (`_ng_rejudge.predecessor_sha256`).
    rejudge_of: Option<Box<str>>,
    classified: Classified,
}

impl OutcomeRow {
    /// Reads and classifies one JSONL line: `None` when it is JSON but not an object.
    pub fn parse(
        bytes: &[u8],
        policy: &ClassificationPolicy,
        retry_terminal_timeouts: bool,
    ) -> Result<Option<Self>, String> {
        let mut row = OutcomeFacts::default();
        if !row.read_line(bytes)? {
            return Ok(None);
        }
        let decision = classify_facts(&row.facts, policy, retry_terminal_timeouts);
        let boxed = |s: Option<String>| s.map(String::into_boxed_str);
        let facts = &row.facts;
        let classified = Classified {
            verdict: decision.verdict,
            terminal: decision.terminal,
            terminal_with_timeout_opt_in: decision.terminal_with_timeout_opt_in,
            not_sent: decision.delivery == Some(p::Delivery::NotSent),
            observed_elapsed: decision.observed_elapsed,
            failure_kind: boxed(decision.failure_kind),
            responsibility: decision.responsibility,
            masked_infrastructure_kind: boxed(decision.masked_infrastructure_kind),
            masked_kept_answer_kind: boxed(decision.masked_kept_answer_kind),
            masked: facts.mask_sample.truthy(),
            has_reward: facts.has_numeric_reward(),
            counts_as_zero: facts.failure_counts_as_zero.truthy(),
            reuse_cached_deliverable: facts.reuse_cached_deliverable.truthy(),
        };
        Ok(Some(Self {
            evidence: facts.omitted_rollout.truthy() || facts.unrouted_run_error.truthy(),
            failure_terminal: facts.failure_terminal.truthy(),
            invalid_judge_response: row.invalid_judge_response.truthy(),
            migrated_invalid_judge: row.migrated_invalid_judge
                && row.failure_class.as_ref().and_then(Value::as_str) == Some("judge_invalid"),
            rejudge_of: row.rejudge_of.map(String::into_boxed_str),
            identity: row.identity,
            attempt: row.attempt,
            run_id: row.run_id,
            failure_class: row.failure_class.map(Box::new),
            failure_record: row.failure_record.map(Box::new),
            classified,
        }))
    }
}

impl OutcomeRow {
    /// `_ng_failure_class` as the index keeps it: `None` when absent or null, a string's text,
    /// any other value's JSON.
    fn failure_class(&self) -> Option<String> {
        self.failure_class
            .as_deref()
            .filter(|v| !v.is_null())
            .map(|v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
    }
}

/// The facts kept of one saved outcome.
#[derive(Debug, Clone)]
struct Outcome {
    artifact: Artifact,
    at: LineAt,
    attempt: i64,
    /// The canonical payload's SHA-256, once a comparison needed it.
    fingerprint: OnceLock<[u8; 32]>,
    failure_class: Option<Box<str>>,
    migrated_invalid_judge: bool,
    /// A result whose `invalid_judge_response` is truthy (the migration's original).
    invalid_judge_response: bool,
    rejudge_of: Option<Box<str>>,
    classified: Classified,
}

/// How two different payloads for one attempt relate (see [`RunIndex::rejudge_link`]).
enum RejudgeLink {
    /// The new line re-judges the attempt's outcome: it takes its place.
    Successor,
    /// The attempt's outcome re-judges the new line: the line is history.
    Predecessor,
    Unrelated,
}

/// What indexing one outcome does to its rollout ([`RunIndex::admit`]).
#[derive(Debug, Clone)]
struct Admitted {
    /// `_ng_failure_class` as the index keeps it ([`OutcomeRow::failure_class`]).
    failure_class: Option<String>,
    position: usize,
    attempt: i64,
    /// A legacy rollout's attempts numbered so far, after this outcome.
    legacy_count: Option<i64>,
    disposition: Disposition,
    /// The outcome (index) a re-judgment takes the place of.
    rejudged: Option<u32>,
}

/// What becomes of an outcome line that its run's files admit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    /// Evidence, not an outcome (an omitted rollout's stand-in, an unrouted run error): no
    /// reader counts it.
    Evidence,
    /// The attempt's outcome: it has none yet.
    New,
    /// The same payload as the attempt's saved outcome: nothing changes.
    AlreadySaved,
    /// It re-judges the attempt's saved outcome (a judge failure it names by SHA-256) and takes
    /// its place.
    Rejudges,
    /// The attempt's saved outcome re-judges it: the line is history.
    RejudgedAlready,
    /// The invalid-judge migration's sidecar copy supersedes it.
    SupersededByMigration,
    /// It is the invalid-judge migration's sidecar copy of the saved result: read first, it
    /// takes the result's place.
    Migrates,
}

/// Whether an outcome line is read from its file or checked before it is saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    Saved,
    Saving,
}

/// What the plan would make of an outcome line a collector is about to save
/// ([`RunIndex::check`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutcomeCheck {
    /// The file the line belongs in: the failures sidecar when `_ng_failure_class` is not
    /// null, else the results file.
    pub artifact: Artifact,
    /// The logical rollout id (absent for evidence).
    pub rollout_id: Option<String>,
    /// The attempt the line is an outcome of (absent for evidence).
    pub attempt: Option<i64>,
    pub disposition: Disposition,
}

/// A manifest's reservations by inventory position (`0`: none), checked against the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservations(Vec<u64>);

/// What the index keeps per expected rollout.
#[derive(Debug, Clone, Default)]
struct Rollout {
    /// Indices into [`RunIndex::outcomes`].
    outcomes: SmallVec<[u32; 3]>,
    counted: u64,
    counted_only_with_opt_in: u64,
    /// The newest attempt with a saved outcome.
    newest: Option<i64>,
    /// The longest observed elapsed time of its failures.
    longest_failure: Option<f64>,
    /// Legacy import: attempts numbered so far.
    legacy_count: i64,
}

type Positions = HashMap<Box<str>, u32, foldhash::fast::RandomState>;

/// A vector in fixed-size segments: it grows without moving what it holds (an index of
/// millions of outcomes is never copied to grow), addressed by `u32`.
#[derive(Debug, Clone)]
struct Segmented<T> {
    segments: Vec<Vec<T>>,
    len: u32,
}

impl<T> Default for Segmented<T> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            len: 0,
        }
    }
}

const SEGMENT: usize = 1 << 14;

impl<T> Segmented<T> {
    fn len(&self) -> u32 {
        self.len
    }

    fn push(&mut self, item: T) {
        if self.segments.last().is_none_or(|s| s.len() == SEGMENT) {
            self.segments.push(Vec::with_capacity(SEGMENT));
        }
        if let Some(segment) = self.segments.last_mut() {
            segment.push(item);
            self.len += 1;
        }
    }
}

impl<T> std::ops::Index<u32> for Segmented<T> {
    type Output = T;
    fn index(&self, i: u32) -> &T {
        &self.segments[i as usize / SEGMENT][i as usize % SEGMENT]
    }
}

impl<T> std::ops::IndexMut<u32> for Segmented<T> {
    fn index_mut(&mut self, i: u32) -> &mut T {
        &mut self.segments[i as usize / SEGMENT][i as usize % SEGMENT]
    }
}

/// Saved outcomes of one run, indexed by rollout and attempt.
#[derive(Debug, Clone)]
pub struct RunIndex {
    run_id: String,
    legacy_import: bool,
    retry_terminal_timeouts: bool,
    policy: ClassificationPolicy,
    options: IndexOptions,
    expected: Vec<Expected>,
    positions: Positions,
    rollouts: Vec<Rollout>,
    outcomes: Segmented<Outcome>,
    warnings: Vec<String>,
    id_buffer: String,
}

impl RunIndex {
    /// Starts an index over the materialized rows' identities (in file order).
    pub fn new(
        manifest: &RunManifest,
        inventory: impl IntoIterator<Item = IdentityFacts>,
        policy: ClassificationPolicy,
        options: IndexOptions,
    ) -> Result<Self, PlanError> {
        let inventory = inventory.into_iter();
        let mut expected = Vec::with_capacity(inventory.size_hint().0);
        let mut positions = Positions::with_capacity_and_hasher(
            inventory.size_hint().0,
            foldhash::fast::RandomState::default(),
        );
        let mut buffer = String::new();
        for row in inventory {
            let rollout_id = row.logical_id(&mut buffer)?.to_owned();
            let position = u32::try_from(expected.len()).unwrap_or(u32::MAX);
            if positions
                .insert(rollout_id.clone().into_boxed_str(), position)
                .is_some()
            {
                return Err(PlanError::DuplicateRollout(rollout_id));
            }
            expected.push(Expected {
                rollout_id,
                task_index: row.task_index,
                rollout_index: row.rollout_index,
            });
        }
        Ok(Self {
            run_id: manifest.run_id.clone(),
            legacy_import: manifest.legacy_import,
            retry_terminal_timeouts: manifest.retry_terminal_timeouts,
            policy,
            options,
            rollouts: vec![Rollout::default(); expected.len()],
            expected,
            positions,
            outcomes: Segmented::default(),
            warnings: Vec::new(),
            id_buffer: buffer,
        })
    }

    /// Whether the run was imported as legacy: its untagged outcomes are numbered in the order
    /// they are read, failures sidecar first.
    pub fn legacy_import(&self) -> bool {
        self.legacy_import
    }

    /// The manifest's reservations by inventory position; every reserved rollout must be in the
    /// inventory.
    pub fn reservations(&self, manifest: &RunManifest) -> Result<Reservations, PlanError> {
        let mut by_position = vec![0; self.expected.len()];
        let mut unknown = Vec::new();
        for (id, next) in &manifest.next_attempt {
            match self.positions.get(id.as_str()) {
                Some(&position) => by_position[position as usize] = *next,
                None => unknown.push(id.clone()),
            }
        }
        if unknown.is_empty() {
            Ok(Reservations(by_position))
        } else {
            Err(PlanError::UnknownReservations(unknown))
        }
    }

    /// Whether the outcomes indexed under an earlier manifest would all be indexed the same way
    /// under `manifest` (whose `reservations` these are): the same run and options, and every
    /// indexed attempt still reserved. When not, build the index again (its first error is the
    /// answer).
    pub fn still_valid_for(&self, manifest: &RunManifest, reservations: &Reservations) -> bool {
        if manifest.run_id != self.run_id
            || manifest.legacy_import != self.legacy_import
            || manifest.retry_terminal_timeouts != self.retry_terminal_timeouts
        {
            return false;
        }
        self.legacy_import
            || self
                .rollouts
                .iter()
                .zip(&reservations.0)
                .all(|(r, reserved)| {
                    r.newest
                        .is_none_or(|newest| u64::try_from(newest).is_ok_and(|n| n < *reserved))
                })
    }

    /// The policy outcomes are classified under (parse rows with it: [`OutcomeRow::parse`]).
    pub fn policy(&self) -> &ClassificationPolicy {
        &self.policy
    }

    /// Whether the run counts terminal timeouts (parse rows with it).
    pub fn retry_terminal_timeouts(&self) -> bool {
        self.retry_terminal_timeouts
    }

    /// Notes collected while indexing (tolerated legacy duplicates).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The expected rollouts in inventory order.
    pub fn expected(&self) -> &[Expected] {
        &self.expected
    }

    /// The inventory position of a rollout.
    pub fn position(&self, rollout_id: &str) -> Option<usize> {
        self.positions.get(rollout_id).map(|p| *p as usize)
    }

    /// Each rollout with a saved outcome and its newest attempt (a legacy import rebuilds the
    /// reservations from these).
    pub fn newest_attempts(&self) -> impl Iterator<Item = (&str, i64)> {
        self.expected
            .iter()
            .zip(&self.rollouts)
            .filter_map(|(e, r)| r.newest.map(|n| (e.rollout_id.as_str(), n)))
    }

    /// How many outcomes are indexed.
    pub fn outcome_count(&self) -> usize {
        self.outcomes.len() as usize
    }

    fn rollout_id(&self, position: usize) -> String {
        self.expected[position].rollout_id.clone()
    }

    fn outcome_of(&self, position: usize, attempt: i64) -> Option<u32> {
        self.rollouts[position]
            .outcomes
            .iter()
            .copied()
            .find(|&o| self.outcomes[o].attempt == attempt)
    }

    /// Whether the outcome `earlier` and the line at `at` hold the same payload.
    fn same_payload(
        &self,
        earlier: u32,
        artifact: Artifact,
        at: LineAt,
        source: &mut dyn LineSource,
    ) -> Result<bool, PlanError> {
        let unreadable = |message: String| PlanError::Unreadable {
            artifact,
            line: at.line,
            message,
        };
        let previous = &self.outcomes[earlier];
        let (previous_artifact, previous_at) = (previous.artifact, previous.at);
        let current = source.read_line(artifact, at).map_err(unreadable)?;
        let old = source
            .read_line(previous_artifact, previous_at)
            .map_err(unreadable)?;
        if trim_newline(&old) == trim_newline(&current) {
            return Ok(true);
        }
        let old_fingerprint = previous.fingerprint.get_or_init(|| fingerprint_line(&old));
        Ok(*old_fingerprint == fingerprint_line(&current))
    }

    /// Indexes one saved outcome, checked against the manifest's `reservations`. Feed the
    /// failures sidecar first, then the results file, each in file order.
    pub fn add(
        &mut self,
        reservations: &Reservations,
        artifact: Artifact,
        at: LineAt,
        row: OutcomeRow,
        source: &mut dyn LineSource,
    ) -> Result<(), PlanError> {
        // The id buffer is lent to the decision (which changes nothing) and taken back.
        let mut buffer = std::mem::take(&mut self.id_buffer);
        let admitted = self.admit(
            reservations,
            Reading::Saved,
            (artifact, at),
            &row,
            source,
            &mut buffer,
        );
        self.id_buffer = buffer;
        self.apply(artifact, at, row, admitted?);
        Ok(())
    }

    /// What the plan would make of `line` (parsed as `row`) if a collector appended it now to
    /// the file its `_ng_failure_class` routes it to (facts §11.2, the module's
    /// `check_outcome`): the rules outcomes read from the files pass, and an explicit attempt
    /// index, which a line being saved must carry. `end_of` tells where each file ends (the
    /// line would be read there); `files` reads the saved lines. Changes nothing.
    pub fn check(
        &self,
        reservations: &Reservations,
        row: &OutcomeRow,
        line: &[u8],
        end_of: impl Fn(Artifact) -> LineAt,
        files: &mut dyn LineSource,
    ) -> Result<OutcomeCheck, PlanError> {
        let artifact = if row.failure_class().is_some() {
            Artifact::Failures
        } else {
            Artifact::Results
        };
        let at = end_of(artifact);
        let mut source = WithCandidate {
            artifact,
            at,
            line,
            files,
        };
        let admitted = self.admit(
            reservations,
            Reading::Saving,
            (artifact, at),
            row,
            &mut source,
            &mut String::new(),
        )?;
        let evidence = admitted.disposition == Disposition::Evidence;
        Ok(OutcomeCheck {
            artifact,
            rollout_id: (!evidence).then(|| self.rollout_id(admitted.position)),
            attempt: (!evidence).then_some(admitted.attempt),
            disposition: admitted.disposition,
        })
    }

    /// What indexing the outcome `row`, saved at `at` in `artifact`, would do, changing
    /// nothing: the one set of rules for outcomes read from the files
    /// ([`Self::add`]) and for a line a collector is about to save ([`Self::check`]).
    ///
    /// A line being saved ([`Reading::Saving`]) is held to what the module's `check_outcome`
    /// asks of it beyond that: an explicit attempt index, and a run id even on a legacy import
    /// (untagged lines are tolerated only as the import found them). And it is decided as the
    /// plan will read it, sidecar first: the invalid-judge migration's sidecar copy of a saved
    /// result takes the result's place.
    fn admit(
        &self,
        reservations: &Reservations,
        reading: Reading,
        (artifact, at): (Artifact, LineAt),
        row: &OutcomeRow,
        source: &mut dyn LineSource,
        id_buffer: &mut String,
    ) -> Result<Admitted, PlanError> {
        let saving = reading == Reading::Saving;
        let line = at.line;
        if row.evidence {
            // `_ng_omitted_rollout` rows (and unrouted run errors) are evidence that no reader
            // counts as a failure or an attempt (facts §14.4): skipped before anything else.
            return Ok(Admitted {
                failure_class: None,
                position: 0,
                attempt: 0,
                legacy_count: None,
                disposition: Disposition::Evidence,
                rejudged: None,
            });
        }
        let legacy = !saving && self.legacy_import && row.run_id.is_none();
        let position = {
            let id = row.identity.logical_id(id_buffer)?;
            match self.positions.get(id) {
                Some(&position) => position as usize,
                None => {
                    return Err(PlanError::NotInInventory {
                        artifact,
                        line,
                        rollout: id.to_owned(),
                    });
                }
            }
        };
        let explicit = match row.attempt {
            AttemptField::Absent if saving => {
                return Err(PlanError::BadAttempt { artifact, line });
            }
            AttemptField::Absent => None,
            AttemptField::Valid(a) => Some(a),
            AttemptField::Invalid => {
                return Err(PlanError::BadAttempt { artifact, line });
            }
        };
        let mut legacy_count = None;
        let attempt = if legacy {
            // Untagged legacy rows are numbered in arrival order; a reused explicit index whose
            // payload differs moves past what this rollout has seen.
            let count = self.rollouts[position].legacy_count;
            let mut attempt = explicit.unwrap_or(count);
            // Saturating: an attempt at `i64::MAX` has no number after it, and a legacy import
            // of it is refused (`recovery_runs::plans::legacy_manifest`), never wrapped.
            if let Some(previous) = self.outcome_of(position, attempt)
                && !self.same_payload(previous, artifact, at, source)?
            {
                attempt = count.max(attempt.saturating_add(1));
            }
            legacy_count = Some(count.max(attempt.saturating_add(1)));
            attempt
        } else {
            explicit.unwrap_or(0)
        };
        let admitted = |disposition, rejudged, failure_class| Admitted {
            failure_class,
            position,
            attempt,
            legacy_count,
            disposition,
            rejudged,
        };
        let expected = &self.expected[position];
        for (field, value, saved) in [
            (
                TASK_INDEX_KEY,
                &row.identity.task_index,
                &expected.task_index,
            ),
            (
                ROLLOUT_INDEX_KEY,
                &row.identity.rollout_index,
                &expected.rollout_index,
            ),
        ] {
            if value != saved {
                return Err(PlanError::MismatchedIndex {
                    artifact,
                    line,
                    rollout: self.rollout_id(position),
                    field,
                });
            }
        }
        let failure_class = row.failure_class();
        if !legacy && (artifact == Artifact::Results) == failure_class.is_some() {
            return Err(PlanError::WrongArtifact { artifact, line });
        }
        let earlier = self.outcome_of(position, attempt);
        if artifact == Artifact::Results
            && let Some(previous) = earlier
            && self.outcomes[previous].migrated_invalid_judge
            && row.invalid_judge_response
        {
            // A crash between the sidecar copy and the main-file rewrite of the invalid-judge
            // migration leaves both; the marked sidecar copy supersedes.
            return Ok(admitted(Disposition::SupersededByMigration, None, None));
        }
        let run_id = row.run_id.as_ref().and_then(|r| r.as_deref());
        if run_id != Some(self.run_id.as_str()) && !legacy {
            return Err(PlanError::DifferentRun { artifact, line });
        }
        if let Some(record) = &row.failure_record {
            self.check_record(
                artifact,
                line,
                self.rollout_id(position),
                attempt,
                row.failure_terminal,
                record,
                &failure_class,
            )?;
        }
        let reserved = reservations.0[position];
        if !legacy && u64::try_from(attempt).map_or(true, |a| a >= reserved) {
            return Err(PlanError::Unreserved {
                artifact,
                line,
                rollout: self.rollout_id(position),
                attempt,
            });
        }
        let Some(previous) = earlier else {
            return Ok(admitted(Disposition::New, None, failure_class));
        };
        if saving
            && artifact == Artifact::Failures
            && self.outcomes[previous].artifact == Artifact::Results
            && self.outcomes[previous].invalid_judge_response
            && row.migrated_invalid_judge
        {
            // The sidecar is read first: there this copy is the attempt's outcome, and the
            // saved result after it is superseded by the migration.
            return Ok(admitted(
                Disposition::Migrates,
                Some(previous),
                failure_class,
            ));
        }
        if self.same_payload(previous, artifact, at, source)? {
            return Ok(admitted(Disposition::AlreadySaved, None, None));
        }
        match self.rejudge_link(previous, artifact, at, row, source)? {
            RejudgeLink::Successor => Ok(admitted(
                Disposition::Rejudges,
                Some(previous),
                failure_class,
            )),
            RejudgeLink::Predecessor => Ok(admitted(Disposition::RejudgedAlready, None, None)),
            RejudgeLink::Unrelated => Err(PlanError::Conflict {
                artifact,
                line,
                rollout: self.rollout_id(position),
                attempt,
            }),
        }
    }

    /// Carries out what [`Self::admit`] decided for `row`.
    fn apply(&mut self, artifact: Artifact, at: LineAt, row: OutcomeRow, admitted: Admitted) {
        if let Some(count) = admitted.legacy_count {
            self.rollouts[admitted.position].legacy_count = count;
        }
        match admitted.disposition {
            Disposition::New => {
                let failure_class = admitted.failure_class;
                self.insert(
                    admitted.position,
                    artifact,
                    at,
                    admitted.attempt,
                    failure_class,
                    row,
                );
            }
            Disposition::Rejudges => {
                if let Some(previous) = admitted.rejudged {
                    let failure_class = admitted.failure_class;
                    self.supersede(previous, artifact, at, failure_class, row);
                }
            }
            Disposition::SupersededByMigration => self.warnings.push(format!(
                "{artifact} line {}: superseded by the invalid-judge migration",
                at.line
            )),
            // Only a line being saved migrates (read from the files, the sidecar comes first).
            Disposition::Evidence
            | Disposition::AlreadySaved
            | Disposition::RejudgedAlready
            | Disposition::Migrates => {}
        }
    }

    /// A canonical failure record is well formed and agrees with its envelope.
    #[allow(clippy::too_many_arguments)]
    fn check_record(
        &self,
        artifact: Artifact,
        line: u64,
        rollout: String,
        attempt: i64,
        failure_terminal: bool,
        record: &Value,
        failure_class: &Option<String>,
    ) -> Result<(), PlanError> {
        let problems = failure_record_problems(record);
        if !problems.is_empty() {
            return Err(PlanError::InvalidFailureRecord {
                artifact,
                line,
                rollout,
                attempt,
                problems: problems.join("; "),
            });
        }
        let episode = &record["episode_id"];
        let consistent = record["run_id"].as_str() == Some(self.run_id.as_str())
            && episode["rollout_id"].as_str() == Some(rollout.as_str())
            && episode["attempt"].as_i64() == Some(attempt)
            && *failure_class == sidecar_failure_class(record)
            && failure_terminal == (record["failure"]["terminal"] == Value::Bool(true));
        if consistent {
            Ok(())
        } else {
            Err(PlanError::InconsistentFailureRecord {
                artifact,
                line,
                rollout,
                attempt,
            })
        }
    }

    /// Records a checked, new outcome and what it adds to its rollout's budget.
    fn insert(
        &mut self,
        position: usize,
        artifact: Artifact,
        at: LineAt,
        attempt: i64,
        failure_class: Option<String>,
        row: OutcomeRow,
    ) {
        let classified = &row.classified;
        let rollout = &mut self.rollouts[position];
        // A resubmit resets every counted failure, masked infrastructure results included.
        let counts_now = at.line
            > match artifact {
                Artifact::Failures => self.options.resubmit_offset,
                Artifact::Results => self.options.resubmit_results_offset,
            };
        if counts_now && failure_class.is_some() && !classified.not_sent {
            if !classified.terminal {
                rollout.counted += 1;
            } else if !classified.terminal_with_timeout_opt_in {
                rollout.counted_only_with_opt_in += 1;
            }
        }
        if counts_now && classified.masked_infrastructure_kind.is_some() {
            rollout.counted += 1;
        }
        rollout.newest = Some(rollout.newest.map_or(attempt, |n| n.max(attempt)));
        if failure_class.is_some()
            && let Some(elapsed) = classified.observed_elapsed
        {
            rollout.longest_failure =
                Some(rollout.longest_failure.map_or(elapsed, |l| l.max(elapsed)));
        }
        rollout.outcomes.push(self.outcomes.len());
        self.outcomes.push(Outcome {
            artifact,
            at,
            attempt,
            fingerprint: OnceLock::new(),
            failure_class: failure_class.map(String::into_boxed_str),
            migrated_invalid_judge: row.migrated_invalid_judge,
            invalid_judge_response: row.invalid_judge_response,
            rejudge_of: row.rejudge_of,
            classified: row.classified,
        });
    }

    /// How the line at `at` (parsed as `row`) and the attempt's outcome `earlier`, two different
    /// payloads for one attempt, are related by a re-judgment: the re-judged outcome names the
    /// SHA-256 of its predecessor's exact bytes (as its admission did), and the predecessor is
    /// a judge failure on a saved answer. The sidecar is read before the results file, so
    /// either may come first.
    fn rejudge_link(
        &self,
        earlier: u32,
        artifact: Artifact,
        at: LineAt,
        row: &OutcomeRow,
        source: &mut dyn LineSource,
    ) -> Result<RejudgeLink, PlanError> {
        let previous = &self.outcomes[earlier];
        let sha_of = |artifact: Artifact, at: LineAt, source: &mut dyn LineSource| {
            source
                .read_line(artifact, at)
                .map(|bytes| crate::canonical::sha256_hex(trim_newline(&bytes)))
                .map_err(|message| PlanError::Unreadable {
                    artifact,
                    line: at.line,
                    message,
                })
        };
        if let Some(named) = &row.rejudge_of
            && previous.classified.verdict == RowVerdict::Rejudge
            && **named == sha_of(previous.artifact, previous.at, source)?
        {
            return Ok(RejudgeLink::Successor);
        }
        if let Some(named) = &previous.rejudge_of
            && row.classified.verdict == RowVerdict::Rejudge
            && **named == sha_of(artifact, at, source)?
        {
            return Ok(RejudgeLink::Predecessor);
        }
        Ok(RejudgeLink::Unrelated)
    }

    /// The re-judged outcome at `at` takes its predecessor's place as the attempt's outcome.
    /// Counts stay: a failure is counted once per attempt, and the predecessor's was.
    fn supersede(
        &mut self,
        earlier: u32,
        artifact: Artifact,
        at: LineAt,
        failure_class: Option<String>,
        row: OutcomeRow,
    ) {
        let outcome = &mut self.outcomes[earlier];
        outcome.artifact = artifact;
        outcome.at = at;
        outcome.fingerprint = OnceLock::new();
        outcome.failure_class = failure_class.map(String::into_boxed_str);
        outcome.migrated_invalid_judge = row.migrated_invalid_judge;
        outcome.invalid_judge_response = row.invalid_judge_response;
        outcome.rejudge_of = row.rejudge_of;
        outcome.classified = row.classified;
    }

    /// Counted failures of a rollout under the run's timeout opt-in.
    fn failure_count(&self, position: usize) -> u64 {
        let rollout = &self.rollouts[position];
        if self.retry_terminal_timeouts {
            rollout.counted + rollout.counted_only_with_opt_in
        } else {
            rollout.counted
        }
    }

    /// The plan as it stands under `manifest` (the one last indexed against, or a later one
    /// [`Self::still_valid_for`] accepted) with its `reservations`, the budget and the
    /// approvals.
    pub fn view<'a>(
        &'a self,
        manifest: &'a RunManifest,
        reservations: &'a Reservations,
        budget: &Budget,
        approvals: &'a BTreeSet<(i64, i64, i64)>,
    ) -> PlanView<'a> {
        PlanView {
            index: self,
            manifest,
            reserved: &reservations.0,
            cap: budget.cap(manifest),
            approvals,
        }
    }
}

fn trim_newline(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\n").unwrap_or(line)
}

/// The canonical payload's SHA-256 of a saved line (its compact serialisation when it has no
/// canonical form, such as a lone surrogate).
pub(crate) fn fingerprint_line(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    match crate::rows::parse_line(bytes) {
        Ok(value) => {
            let text =
                crate::canonical::canonical_value(&value).unwrap_or_else(|_| value.to_string());
            sha2::Sha256::digest(text.as_bytes()).into()
        }
        Err(_) => sha2::Sha256::digest(bytes).into(),
    }
}

/// A rollout's state as a view decides it.
struct Decided<'a> {
    state: PlanState,
    latest: Option<i64>,
    next: i64,
    counted: u64,
    outcome: Option<&'a Outcome>,
}

/// The plan of an index under one manifest, cap and set of approvals.
#[derive(Debug, Clone, Copy)]
pub struct PlanView<'a> {
    index: &'a RunIndex,
    manifest: &'a RunManifest,
    /// Reservations by inventory position.
    reserved: &'a [u64],
    cap: u64,
    approvals: &'a BTreeSet<(i64, i64, i64)>,
}

/// The plan's summary: counts per state, coverage, the budget message, and each state's rollouts
/// (inventory positions, in inventory order) for paging.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanSummary {
    pub run_id: String,
    pub cap: u64,
    pub state_counts: BTreeMap<PlanState, u64>,
    pub coverage: Coverage,
    pub budget_message: Option<String>,
    pub warnings: Vec<String>,
    #[serde(skip)]
    by_state: BTreeMap<PlanState, Vec<u32>>,
}

impl PlanSummary {
    /// Inventory positions in `state` (every rollout for `None`) from `after` on (exclusive),
    /// at most `limit`, and whether more follow.
    pub fn positions(
        &self,
        state: Option<PlanState>,
        after: Option<usize>,
        limit: usize,
    ) -> (Vec<usize>, bool) {
        // A cursor at the last position there is lists nothing after it (never wraps to 0).
        let start = after.map_or(0, |a| a.saturating_add(1));
        match state {
            Some(state) => {
                let all = self.by_state.get(&state).map_or(&[][..], Vec::as_slice);
                let from = all.partition_point(|&p| (p as usize) < start);
                let page: Vec<usize> = all[from..]
                    .iter()
                    .take(limit)
                    .map(|&p| p as usize)
                    .collect();
                let more = all.len() > from + page.len();
                (page, more)
            }
            None => {
                let total = self.coverage.expected as usize;
                let end = total.min(start.saturating_add(limit));
                ((start.min(end)..end).collect(), end < total)
            }
        }
    }
}

impl<'a> PlanView<'a> {
    pub fn cap(&self) -> u64 {
        self.cap
    }

    fn decide(&self, position: usize) -> Decided<'a> {
        let index = self.index;
        let expected = &index.expected[position];
        let rollout = &index.rollouts[position];
        let reserved = Some(self.reserved[position]).filter(|n| *n > 0);
        let from_reservation = reserved.map(|n| i64::try_from(n).unwrap_or(i64::MAX) - 1);
        let latest = match (from_reservation, rollout.newest) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let counted = index.failure_count(position);
        let next = reserved.map_or_else(
            || latest.map_or(0, |l| l.saturating_add(1)),
            |n| i64::try_from(n).unwrap_or(i64::MAX),
        );
        let outcome = latest
            .and_then(|l| index.outcome_of(position, l))
            .map(|o| &index.outcomes[o]);
        // A rollout at the last execution number a manifest keeps has none to run again
        // (reserve refuses it; hostile review 46, N6: the plan offered it).
        let numbers_left = next < i64::MAX;
        let within_budget = |state_if_ok: PlanState| {
            if counted < self.cap && numbers_left {
                state_if_ok
            } else {
                PlanState::Exhausted
            }
        };
        let state = match (latest, outcome) {
            (None, _) => PlanState::Missing,
            (Some(_), None) => within_budget(PlanState::Missing),
            (Some(attempt), Some(outcome)) => match outcome.classified.verdict {
                RowVerdict::Omitted => PlanState::Omitted,
                RowVerdict::Keep => PlanState::Scored,
                RowVerdict::ModelFinal => PlanState::ModelFinal,
                RowVerdict::Rejudge => PlanState::JudgeRecoverable,
                RowVerdict::Terminal => PlanState::Terminal,
                RowVerdict::KeepMasked => PlanState::Masked,
                RowVerdict::NeedsApproval => {
                    let (task, rollout) = expected.approval_indices();
                    if self.approvals.contains(&(task, rollout, attempt)) {
                        PlanState::ApprovedRerun
                    } else {
                        PlanState::AwaitingApproval
                    }
                }
                RowVerdict::Retry => within_budget(PlanState::Retryable),
            },
        };
        Decided {
            state,
            latest,
            next,
            counted,
            outcome,
        }
    }

    /// Why a rollout is in its state.
    fn reason(&self, decided: &Decided<'_>) -> String {
        let outcome = decided.outcome;
        match decided.state {
            PlanState::Missing if decided.latest.is_none() => {
                "never dispatched: resume starts it from its input".to_owned()
            }
            PlanState::Missing => {
                "the latest reserved attempt saved no outcome: resume runs it again".to_owned()
            }
            PlanState::Exhausted if decided.next == i64::MAX => format!(
                "no execution number is left after attempt {} (the largest a manifest keeps is {})",
                decided.next - 1,
                i64::MAX
            ),
            PlanState::Exhausted if outcome.is_none() => {
                "the latest reserved attempt saved no outcome: resume runs it again".to_owned()
            }
            PlanState::Omitted => "intentionally omitted".to_owned(),
            PlanState::Scored => "a completed result: kept, never rerun".to_owned(),
            PlanState::ModelFinal => {
                if outcome.is_some_and(|o| o.classified.counts_as_zero) {
                    "the evaluated model's failure, counted as zero: never sampled again".to_owned()
                } else {
                    "the agent ran out of its own deadline and kept its answer: never sampled again"
                        .to_owned()
                }
            }
            PlanState::JudgeRecoverable => {
                "the judge failed on a saved answer: re-judge it only".to_owned()
            }
            PlanState::Terminal => {
                if outcome.is_some_and(|o| {
                    o.classified.terminal || o.classified.terminal_with_timeout_opt_in
                }) {
                    "a terminal failure: gated on resume".to_owned()
                } else {
                    "a failure naming no cause holds a response: rerunning could replace a saved answer".to_owned()
                }
            }
            PlanState::Masked => "a masked result: retained, not measured".to_owned(),
            PlanState::ApprovedRerun => {
                "an operator approved rerunning this masked attempt".to_owned()
            }
            PlanState::AwaitingApproval => format!(
                "masked ({}) with a kept answer and no grade: rerun only with an operator's approval",
                outcome
                    .and_then(|o| o.classified.masked_kept_answer_kind.as_deref())
                    .unwrap_or("unknown")
            ),
            PlanState::Retryable | PlanState::Exhausted => {
                let what = match outcome
                    .and_then(|o| o.classified.masked_infrastructure_kind.as_deref())
                {
                    Some(kind) => {
                        format!("masked by infrastructure ({kind}) without a saved answer")
                    }
                    None => format!(
                        "a retryable failure ({})",
                        outcome
                            .and_then(|o| o.failure_class.as_deref())
                            .unwrap_or("unknown")
                    ),
                };
                match decided.state {
                    PlanState::Exhausted => format!(
                        "{what}: counted failures {} of a cap of {}, used up; extend the attempts to retry",
                        decided.counted, self.cap
                    ),
                    _ => format!("{what}: retried within the cap"),
                }
            }
        }
    }

    /// The plan entry of the rollout at `position` (inventory order).
    pub fn entry(&self, position: usize) -> PlanEntry {
        let index = self.index;
        let expected = &index.expected[position];
        let decided = self.decide(position);
        let outcome = decided.outcome;
        let runnable = matches!(
            decided.state,
            PlanState::Missing | PlanState::Retryable | PlanState::ApprovedRerun
        );
        PlanEntry {
            rollout_id: expected.rollout_id.clone(),
            task_index: expected.task_index.to_value(),
            rollout_index: expected.rollout_index.to_value(),
            state: decided.state,
            reason: self.reason(&decided),
            latest_attempt: decided.latest,
            next_attempt: runnable.then_some(decided.next),
            counted_failures: decided.counted,
            reuse_cached_deliverable: runnable && self.reuse_cached_deliverable(position),
            longest_failure_elapsed: index.rollouts[position].longest_failure,
            latest_artifact: outcome.map(|o| o.artifact),
            latest_line: outcome.map(|o| o.at.line),
            failure_kind: outcome
                .and_then(|o| o.classified.failure_kind.as_deref().map(str::to_owned)),
            responsibility: outcome
                .filter(|o| o.failure_class.is_some() || o.classified.masked)
                .map(|o| o.classified.responsibility),
        }
    }

    /// The plan entry of a rollout by id.
    pub fn entry_for(&self, rollout_id: &str) -> Option<PlanEntry> {
        self.index.position(rollout_id).map(|p| self.entry(p))
    }

    /// The plan entry of the rollout with these indices.
    pub fn entry_at_indices(&self, task_index: i64, rollout_index: i64) -> Option<PlanEntry> {
        self.index
            .expected
            .iter()
            .position(|e| {
                e.task_index.as_index() == Some(task_index)
                    && e.rollout_index.as_index() == Some(rollout_index)
            })
            .map(|p| self.entry(p))
    }

    /// The newest recorded outcome carries `reuse_cached_deliverable` and is not an omission.
    fn reuse_cached_deliverable(&self, position: usize) -> bool {
        let index = self.index;
        index.rollouts[position]
            .newest
            .and_then(|attempt| index.outcome_of(position, attempt))
            .map(|o| &index.outcomes[o])
            .is_some_and(|o| {
                o.classified.reuse_cached_deliverable && o.classified.verdict != RowVerdict::Omitted
            })
    }

    /// Counts, coverage and each state's rollouts: one pass over the rollouts, no entry built.
    pub fn summary(&self) -> PlanSummary {
        let index = self.index;
        let mut tally = Tally::default();
        let mut by_state: BTreeMap<PlanState, Vec<u32>> = BTreeMap::new();
        // Contiguous ranges in inventory order, merged in that order: each state's positions
        // stay sorted.
        for (part_tally, part_states) in self.summarize_in_parts() {
            tally.merge(&part_tally);
            for (state, positions) in part_states {
                by_state.entry(state).or_default().extend(positions);
            }
        }
        let state_counts: BTreeMap<PlanState, u64> = by_state
            .iter()
            .map(|(state, positions)| (*state, positions.len() as u64))
            .collect();
        let count = |state| state_counts.get(&state).copied().unwrap_or(0);
        let exhausted = count(PlanState::Exhausted);
        let coverage = tally.coverage(
            self.manifest,
            index.expected.len() as u64,
            self.cap,
            count(PlanState::ModelFinal),
            exhausted,
        );
        let cap = self.cap;
        PlanSummary {
            run_id: index.run_id.clone(),
            cap,
            state_counts,
            coverage,
            budget_message: (exhausted > 0).then(|| {
                format!(
                    "Retry budget exhausted for {exhausted} rollout(s) at the cap of {cap} counted failures. \
                     They will not be dispatched with this cap."
                )
            }),
            warnings: index.warnings.clone(),
            by_state,
        }
    }

    /// Every rollout decided and tallied, the inventory cut into one contiguous range per core
    /// when it is large (deciding is independent per rollout; measured on 2 cores, 100k
    /// rollouts: the summary is most of a warm `GET /plan`). In inventory order.
    fn summarize_in_parts(&self) -> Vec<(Tally, BTreeMap<PlanState, Vec<u32>>)> {
        /// Below this, a thread costs more than it saves.
        const PER_PART: usize = 16_384;
        let rollouts = self.index.expected.len();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let parts = rollouts.div_ceil(PER_PART).clamp(1, cores);
        if parts == 1 {
            return vec![self.summarize(0..rollouts)];
        }
        let size = rollouts.div_ceil(parts);
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..rollouts)
                .step_by(size)
                .map(|start| {
                    scope.spawn(move || self.summarize(start..(start + size).min(rollouts)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }

    /// The tally and each state's positions over `positions`.
    fn summarize(
        &self,
        positions: std::ops::Range<usize>,
    ) -> (Tally, BTreeMap<PlanState, Vec<u32>>) {
        let mut tally = Tally::default();
        let mut by_state: BTreeMap<PlanState, Vec<u32>> = BTreeMap::new();
        for position in positions {
            let decided = self.decide(position);
            by_state
                .entry(decided.state)
                .or_default()
                .push(u32::try_from(position).unwrap_or(u32::MAX));
            tally.add(&decided, self.reserved[position]);
        }
        (tally, by_state)
    }

    /// The whole plan: every entry, and the summary's coverage.
    pub fn plan(&self) -> ResumePlan {
        let summary = self.summary();
        ResumePlan {
            run_id: summary.run_id,
            cap: summary.cap,
            entries: (0..self.index.expected.len())
                .map(|p| self.entry(p))
                .collect(),
            coverage: summary.coverage,
            budget_message: summary.budget_message,
            warnings: summary.warnings,
        }
    }
}

/// Coverage counts gathered over the rollouts.
#[derive(Debug, Default)]
struct Tally {
    success: u64,
    failure: u64,
    omitted: u64,
    unknown: u64,
    masked: u64,
    unscored: u64,
    dispatched: u64,
    attempts: u64,
    counted_failures: u64,
}

impl Tally {
    /// Adds another range's counts.
    fn merge(&mut self, other: &Tally) {
        self.success += other.success;
        self.failure += other.failure;
        self.omitted += other.omitted;
        self.unknown += other.unknown;
        self.masked += other.masked;
        self.unscored += other.unscored;
        self.dispatched += other.dispatched;
        self.attempts += other.attempts;
        self.counted_failures += other.counted_failures;
    }

    fn add(&mut self, decided: &Decided<'_>, reserved: u64) {
        self.counted_failures += decided.counted;
        if let Some(latest) = decided.latest {
            self.dispatched += 1;
            self.attempts += reserved.max(u64::try_from(latest).unwrap_or(0) + 1);
        }
        // The disposition of the latest attempt (`success`, `failure`, `omitted`, `unknown`).
        match decided.outcome {
            None => self.unknown += 1,
            Some(o) if o.classified.verdict == RowVerdict::Omitted => self.omitted += 1,
            Some(o) if o.failure_class.is_some() => self.failure += 1,
            Some(o) => {
                self.success += 1;
                if !o.classified.has_reward {
                    self.unscored += 1;
                } else if o.classified.masked {
                    self.masked += 1;
                }
            }
        }
    }

    fn coverage(
        &self,
        manifest: &RunManifest,
        expected: u64,
        cap: u64,
        failures_counted_as_zero: u64,
        attempts_exhausted: u64,
    ) -> Coverage {
        let measured = self.success - self.masked - self.unscored;
        Coverage {
            schema_version: 2,
            selection_policy: crate::manifest::SELECTION_POLICY.to_owned(),
            run_id: manifest.run_id.clone(),
            expected,
            successful: self.success,
            measured,
            masked: self.masked,
            unscored: self.unscored,
            failed: self.failure,
            intentionally_omitted: self.omitted,
            unknown: self.unknown,
            never_dispatched: expected - self.dispatched,
            attempts: self.attempts,
            counted_failures: self.counted_failures,
            attempts_exhausted,
            max_rollout_attempts: cap,
            retry_terminal_timeouts: manifest.retry_terminal_timeouts,
            completion_fraction: if expected == 0 {
                1.0
            } else {
                self.success as f64 / expected as f64
            },
            complete: self.success == expected,
            reconciled: self.unknown == 0,
            identity_verified: !(manifest.legacy_import || manifest.identity_overridden),
            scored: measured + failures_counted_as_zero,
            failures_counted_as_zero,
        }
    }
}
