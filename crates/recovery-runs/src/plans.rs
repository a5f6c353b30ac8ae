//! Resume plans of runs, indexed once per run and brought up to date by reading only what was
//! appended since (blocking file work: call from blocking threads).
//!
//! Invariants:
//! - a cached index is reused only while everything it was built from stands: the same
//!   materialized inputs (file identity, or their SHA-256 while the file is recent enough for a
//!   same-size rewrite to hide), the same classification policy and resubmit offset, a manifest
//!   it still holds for ([`RunIndex::still_valid_for`]), and outcome files that only grew (same
//!   device and inode, at least as long, and the bytes before the read mark unchanged); anything
//!   else rebuilds from scratch, as does any outcome the incremental read refuses, so a cached
//!   plan always equals the plan built cold from the same files;
//! - outcome files are measured before the manifest is read and read only up to those sizes: a
//!   collector reserves an attempt (manifest first) before it saves the attempt's outcome, so
//!   every outcome read has its reservation in the manifest read;
//! - callers of one run wait for each other's refresh (one read of the files, not one per
//!   caller); callers of different runs never do; a bounded number of runs stay cached.

use crate::cache::FileIdentity;
use crate::runfiles::{self, RunFilesError};
use recovery_core::failure::ClassificationPolicy;
use recovery_core::journals::ApprovalTriple;
use recovery_core::manifest::RunManifest;
use recovery_core::plan::{
    Artifact, Budget, IndexOptions, JsonlMark, LineAt, LineSource, OutcomeCheck, OutcomeRow,
    OutcomesError, PlanError, PlanSummary, PlanView, Reservations, RunIndex, index_outcomes,
    read_inventory,
};
use recovery_sidecar::SidecarPaths;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// How many runs keep their index in memory.
const CACHED_RUNS: usize = 8;

/// Bytes before a read mark that must be unchanged for the file to count as only appended to.
const GUARD_BYTES: u64 = 256;

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Where an outcome file was read to, and what it was then.
#[derive(Debug, Clone, Default)]
struct Mark {
    /// (device, inode); `None` for a file that did not exist.
    file: Option<(u64, u64)>,
    read: JsonlMark,
    /// The bytes just before `read.offset`.
    guard: Vec<u8>,
}

/// An outcome file as measured before the manifest is read.
#[derive(Debug)]
struct Measured {
    file: Option<File>,
    identity: Option<(u64, u64)>,
    size: u64,
}

impl Measured {
    fn of(path: &Path) -> Result<Self, RunFilesError> {
        match recovery_sidecar::open_regular(path) {
            Ok(file) => {
                let metadata = file.metadata().map_err(|e| io(path, e))?;
                Ok(Self {
                    identity: Some((metadata.dev(), metadata.ino())),
                    size: metadata.size(),
                    file: Some(file),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self {
                file: None,
                identity: None,
                size: 0,
            }),
            Err(e) => Err(unreadable_companion(path, e)),
        }
    }

    /// Whether the file is the one `mark` was read from, only appended to since.
    fn continues(&self, mark: &Mark) -> bool {
        if self.identity != mark.file || self.size < mark.read.offset {
            return false;
        }
        let Some(file) = &self.file else {
            return mark.read.offset == 0;
        };
        let mut guard = vec![0u8; mark.guard.len()];
        let start = mark.read.offset - mark.guard.len() as u64;
        file.read_exact_at(&mut guard, start).is_ok() && guard == mark.guard
    }

    fn guard_before(&self, offset: u64) -> Vec<u8> {
        let Some(file) = &self.file else {
            return Vec::new();
        };
        let start = offset.saturating_sub(GUARD_BYTES);
        let mut guard = vec![0u8; (offset - start) as usize];
        match file.read_exact_at(&mut guard, start) {
            Ok(()) => guard,
            Err(_) => Vec::new(),
        }
    }
}

/// A run's file that is there but cannot be opened as a regular file (a symbolic link, a FIFO,
/// a directory, no permission): the run's files are invalid, and the message says why.
fn unreadable_companion(path: &Path, source: std::io::Error) -> RunFilesError {
    RunFilesError::Inconsistent(format!("{} cannot be read: {source}", path.display()))
}

fn io(path: &Path, source: std::io::Error) -> RunFilesError {
    RunFilesError::Io {
        context: format!("reading {}", path.display()),
        source,
    }
}

/// Saved lines read back by position (to compare two outcomes of one attempt).
struct FileLines<'a> {
    failures: Option<&'a File>,
    results: Option<&'a File>,
}

impl LineSource for FileLines<'_> {
    fn read_line(&mut self, artifact: Artifact, at: LineAt) -> Result<Vec<u8>, String> {
        let file = match artifact {
            Artifact::Failures => self.failures,
            Artifact::Results => self.results,
        }
        .ok_or("the file is gone")?;
        let mut line = vec![0u8; usize::try_from(at.length).map_err(|e| e.to_string())?];
        file.read_exact_at(&mut line, at.offset)
            .map_err(|e| e.to_string())?;
        Ok(line)
    }
}

/// A reader that hashes what passes through it.
struct Hashing<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// The materialized inputs as an index was built from them.
#[derive(Debug, Clone)]
struct Inventory {
    identity: FileIdentity,
    sha256: [u8; 32],
}

impl Inventory {
    /// Whether the file at `path` still holds what was indexed.
    fn stands(&self, path: &Path) -> bool {
        let Ok(now) = FileIdentity::of(path) else {
            return false;
        };
        if now == self.identity && !now.is_racy() {
            return true;
        }
        recovery_sidecar::open_regular(path)
            .and_then(|mut file| {
                let mut hasher = Sha256::new();
                std::io::copy(&mut file, &mut hasher)?;
                Ok(<[u8; 32]>::from(hasher.finalize()))
            })
            .is_ok_and(|sha256| sha256 == self.sha256)
    }
}

/// A run's index, what it was built from, and the manifest it was last checked against.
#[derive(Debug)]
struct Indexed {
    inventory: Inventory,
    policy_bytes: Option<Vec<u8>>,
    options: IndexOptions,
    index: RunIndex,
    marks: [Mark; 2],
    manifest: Arc<RunManifest>,
    reservations: Reservations,
    /// The materialized inputs' digest (their content is what [`Self::inventory`] vouches for).
    materialized_digest: String,
    /// The summary last computed over this index, and what it was computed under.
    summary: SummaryCell,
}

/// The summary last computed over an index, and what it was computed under.
type SummaryCell = Mutex<Option<(SummaryInputs, PlanSummary)>>;

/// Everything a summary depends on besides the index's rows: while these are the same and the
/// index read nothing more (its marks), the summary is the same, and is not counted again.
#[derive(Debug, Clone)]
struct SummaryInputs {
    read_to: [u64; 2],
    manifest: Arc<RunManifest>,
    default_cap: u64,
    extension: u64,
    approvals: BTreeSet<ApprovalTriple>,
}

impl PartialEq for SummaryInputs {
    fn eq(&self, other: &Self) -> bool {
        // The manifest by identity: a manifest read again is another `Arc` (holding ours keeps
        // its address from being reused).
        self.read_to == other.read_to
            && Arc::ptr_eq(&self.manifest, &other.manifest)
            && self.default_cap == other.default_cap
            && self.extension == other.extension
            && self.approvals == other.approvals
    }
}

impl Indexed {
    /// Whether the index stands for the files as measured now and the manifest read now (its
    /// reservations taken once per manifest).
    fn fits(
        &mut self,
        paths: &SidecarPaths,
        manifest: &Arc<RunManifest>,
        (options, policy_bytes): (&IndexOptions, &Option<Vec<u8>>),
        measured: &[Measured; 2],
    ) -> bool {
        let unchanged = self.options == *options
            && self.policy_bytes == *policy_bytes
            && measured[0].continues(&self.marks[0])
            && measured[1].continues(&self.marks[1])
            && self.inventory.stands(&paths.materialized);
        if !unchanged {
            return false;
        }
        if Arc::ptr_eq(&self.manifest, manifest) {
            return true;
        }
        match self.index.reservations(manifest) {
            Ok(reservations) if self.index.still_valid_for(manifest, &reservations) => {
                self.reservations = reservations;
                self.manifest = manifest.clone();
                true
            }
            _ => false,
        }
    }
}

/// A run's manifest as last read, kept with its bytes so an unchanged one is not parsed again.
#[derive(Debug, Clone)]
struct ReadManifest {
    bytes: Vec<u8>,
    manifest: Arc<RunManifest>,
}

#[derive(Debug, Default)]
struct Slot {
    manifest: Option<ReadManifest>,
    indexed: Option<Indexed>,
}

/// The plan of a run as it stands: its manifest, index and budget, viewed on demand.
#[derive(Debug)]
pub struct RunPlan<'a> {
    pub manifest: &'a RunManifest,
    index: &'a RunIndex,
    reservations: &'a Reservations,
    budget: Budget,
    approvals: BTreeSet<ApprovalTriple>,
    /// The index's summary cache and the inputs of this plan.
    summary: Option<(&'a SummaryCell, SummaryInputs)>,
    /// The outcome files as measured for this plan (failures, results) and where the index
    /// read them to: a checked line would be read there.
    outcome_files: &'a [Measured; 2],
    read_to: [JsonlMark; 2],
}

/// Why a line a collector is about to save would not be admitted ([`RunPlan::check_outcome`]).
#[derive(Debug, thiserror::Error)]
pub enum OutcomeRefusal {
    #[error("line: not one JSONL line (it holds a line end before its last byte)")]
    NotOneLine,
    /// Nothing but whitespace as Python's `bytes.strip()` sees it: a line every reader skips.
    #[error(
        "line: blank (whitespace only): every reader of the run's files skips it, so it saves no outcome"
    )]
    Blank,
    #[error("line: Malformed JSON: {0}")]
    Malformed(String),
    #[error("line: a saved outcome must be a JSON object")]
    NotAnObject,
    /// A rule of the plan (facts §11.2): what reading the line from its file would refuse.
    #[error("line: {0}")]
    Refused(#[from] PlanError),
}

impl OutcomeRefusal {
    /// A stable snake_case name of the rule refused.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotOneLine => "not_one_line",
            Self::Blank => "blank_line",
            Self::Malformed(_) => "malformed_json",
            Self::NotAnObject => "not_an_object",
            Self::Refused(error) => error.reason(),
        }
    }
}

/// The attempt that used an approval of `(task, rollout, attempt)`, read from the run's files:
/// an approval names its rollout's latest attempt when given, so once a later attempt was
/// reserved (the next one, `attempt + 1`, is the rerun it allowed) the approval is spent.
pub fn approval_used_by(
    view: &PlanView<'_>,
    (task, rollout, attempt): (i64, i64, i64),
) -> Option<i64> {
    view.entry_at_indices(task, rollout)?
        .latest_attempt
        .filter(|latest| *latest > attempt)
        .map(|_| attempt + 1)
}

impl RunPlan<'_> {
    /// The plan under the run's manifest, cap and approvals.
    pub fn view(&self) -> PlanView<'_> {
        self.index.view(
            self.manifest,
            self.reservations,
            &self.budget,
            &self.approvals,
        )
    }

    /// Counts, coverage and each state's rollouts: counted once per state of the run's files,
    /// manifest, cap and approvals (a repeated `GET /plan` or console page costs a copy).
    pub fn summary(&self) -> PlanSummary {
        let mut summary = self.counted_summary();
        summary.warnings.extend(self.torn_tail_warnings());
        summary
    }

    /// The whole plan, every rollout's entry (the offline `plan` command's).
    pub fn resume_plan(&self) -> recovery_core::plan::ResumePlan {
        let mut plan = self.view().plan();
        plan.warnings.extend(self.torn_tail_warnings());
        plan
    }

    fn counted_summary(&self) -> PlanSummary {
        let Some((cell, inputs)) = &self.summary else {
            return self.view().summary();
        };
        let mut cached = cell.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((at, summary)) = cached.as_ref()
            && at == inputs
        {
            return summary.clone();
        }
        let summary = self.view().summary();
        *cached = Some((inputs.clone(), summary.clone()));
        summary
    }

    /// An outcome file that ends in an unterminated line that does not parse (a collector
    /// stopped mid-write) was read up to that line, which is no outcome until its writer ends
    /// it: facts §11.1's "ignored with a warning" (hostile review 53, F3: the plan said
    /// nothing). An unterminated line that parses is an outcome, counted, and not warned of.
    fn torn_tail_warnings(&self) -> Vec<String> {
        [Artifact::Failures, Artifact::Results]
            .into_iter()
            .zip(self.outcome_files.iter().zip(self.read_to))
            .filter(|(_, (file, read))| self.is_torn_tail(file, read.offset))
            .map(|(artifact, (file, read))| {
                format!(
                    "{artifact} line {}: an unterminated final line ({} bytes at byte {}) is an \
                     interrupted write, not read until its writer ends it",
                    read.lines + 1,
                    file.size - read.offset,
                    read.offset
                )
            })
            .collect()
    }

    /// Whether `file` holds bytes after `offset` (where its read stopped) that are an
    /// unterminated line the index does not count: neither blank nor parsed as an outcome. A
    /// tail longer than any line a reader would take is torn without reading it.
    fn is_torn_tail(&self, file: &Measured, offset: u64) -> bool {
        const LONGEST_READ: u64 = 64 << 20;
        let (Some(handle), Some(length)) = (&file.file, file.size.checked_sub(offset)) else {
            return false;
        };
        if length == 0 {
            return false;
        }
        if length > LONGEST_READ {
            return true;
        }
        let mut tail = vec![0u8; length as usize];
        if handle.read_exact_at(&mut tail, offset).is_err() {
            return false;
        }
        !recovery_core::rows::is_blank(&tail)
            && !matches!(
                OutcomeRow::parse(
                    &tail,
                    self.index.policy(),
                    self.index.retry_terminal_timeouts()
                ),
                Ok(Some(_))
            )
    }

    /// How many outcomes the index holds.
    pub fn outcomes(&self) -> usize {
        self.index.outcome_count()
    }

    /// What this plan would make of `line` (one JSONL line, its final `\n` optional) if a
    /// collector appended it now to the file its `_ng_failure_class` routes it to: the module's
    /// `check_outcome` (facts §11.2), by the rules the plan reads saved lines with, so a line
    /// it admits never stops the plan. Reads saved lines to compare payloads; writes nothing.
    pub fn check_outcome(&self, line: &[u8]) -> Result<OutcomeCheck, OutcomeRefusal> {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        if line.contains(&b'\n') {
            return Err(OutcomeRefusal::NotOneLine);
        }
        if recovery_core::rows::is_blank(line) {
            return Err(OutcomeRefusal::Blank);
        }
        let row = OutcomeRow::parse(
            line,
            self.index.policy(),
            self.index.retry_terminal_timeouts(),
        )
        .map_err(OutcomeRefusal::Malformed)?
        .ok_or(OutcomeRefusal::NotAnObject)?;
        let read_to = self.read_to;
        let end_of = |artifact: Artifact| {
            let mark = read_to[match artifact {
                Artifact::Failures => 0,
                Artifact::Results => 1,
            }];
            LineAt {
                line: mark.lines + 1,
                offset: mark.offset,
                length: line.len() as u64 + 1,
            }
        };
        let mut files = FileLines {
            failures: self.outcome_files[0].file.as_ref(),
            results: self.outcome_files[1].file.as_ref(),
        };
        Ok(self
            .index
            .check(self.reservations, &row, line, end_of, &mut files)?)
    }
}

/// Resume plans by run, kept up to date with the files.
#[derive(Debug, Default)]
pub struct PlanCache {
    slots: Mutex<Vec<(PathBuf, Arc<Mutex<Slot>>)>>,
    counts: Counts,
}

/// How plans were answered.
#[derive(Debug, Default)]
struct Counts {
    builds: AtomicU64,
    catch_ups: AtomicU64,
}

/// How many plans a cache built from scratch and how many it answered by catching up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanCounts {
    pub builds: u64,
    pub catch_ups: u64,
}

impl PlanCache {
    /// Of the approvals given as `(key, (task, rollout, attempt))`, those an attempt reserved
    /// since has used ([`approval_used_by`]), with that attempt, as the run's files tell; none
    /// when the files cannot be planned (the plan reports why). Reads files: a blocking call.
    pub fn used_approvals<K>(
        &self,
        paths: &SidecarPaths,
        default_cap: u64,
        approvals: Vec<(K, (i64, i64, i64))>,
    ) -> Vec<(K, i64)> {
        self.with_plan(paths, default_cap, |plan| {
            let view = plan.view();
            approvals
                .into_iter()
                .filter_map(|(key, triple)| approval_used_by(&view, triple).map(|n| (key, n)))
                .collect()
        })
        .unwrap_or_default()
    }

    /// Runs `work` over the run's plan as its files stand now.
    pub fn with_plan<T>(
        &self,
        paths: &SidecarPaths,
        default_cap: u64,
        work: impl FnOnce(&RunPlan<'_>) -> T,
    ) -> Result<T, RunFilesError> {
        let slot = self.slot(&paths.manifest);
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        refresh(&mut slot, paths, default_cap, &self.counts, work)
    }

    /// How plans were answered so far.
    pub fn counts(&self) -> PlanCounts {
        PlanCounts {
            builds: self.counts.builds.load(Ordering::Relaxed),
            catch_ups: self.counts.catch_ups.load(Ordering::Relaxed),
        }
    }

    /// The run's slot, most recently used first; the least recently used run beyond
    /// [`CACHED_RUNS`] is forgotten.
    fn slot(&self, manifest: &Path) -> Arc<Mutex<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = match slots.iter().position(|(path, _)| path == manifest) {
            Some(i) => slots.remove(i).1,
            None => Arc::default(),
        };
        slots.insert(0, (manifest.to_owned(), slot.clone()));
        slots.truncate(CACHED_RUNS);
        slot
    }
}

/// Builds the plan of a run from its files, nothing cached (the offline CLI).
pub fn plan_once<T>(
    paths: &SidecarPaths,
    default_cap: u64,
    work: impl FnOnce(&RunPlan<'_>) -> T,
) -> Result<T, RunFilesError> {
    refresh(
        &mut Slot::default(),
        paths,
        default_cap,
        &Counts::default(),
        work,
    )
}

fn refresh<T>(
    slot: &mut Slot,
    paths: &SidecarPaths,
    default_cap: u64,
    counts: &Counts,
    work: impl FnOnce(&RunPlan<'_>) -> T,
) -> Result<T, RunFilesError> {
    runfiles::check_run_files(paths)?;
    // Outcome files first: everything below these sizes had its attempt reserved in the
    // manifest read next.
    let measured = [
        Measured::of(&paths.failures)?,
        Measured::of(&paths.output.clone())?,
    ];
    let manifest = read_manifest(slot.manifest.take(), &paths.manifest)?;
    slot.manifest = Some(manifest.clone());
    let manifest = manifest.manifest;

    let policy_bytes = match recovery_sidecar::read_regular(&paths.classification_policy) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(unreadable_companion(&paths.classification_policy, e)),
    };
    let runfiles::BudgetInputs {
        extension,
        options,
        approvals,
    } = runfiles::budget_inputs(paths)?;
    let reusable = slot.indexed.take().and_then(|mut indexed| {
        indexed
            .fits(paths, &manifest, (&options, &policy_bytes), &measured)
            .then_some(indexed)
    });
    if let Some(indexed) = &reusable {
        runfiles::check_materialized_digest(&manifest, &indexed.materialized_digest, paths)?;
    }
    let indexed = match reusable.map(|indexed| catch_up(indexed, paths, &measured)) {
        Some(Ok(indexed)) => {
            counts.catch_ups.fetch_add(1, Ordering::Relaxed);
            indexed
        }
        // A refusal while catching up is decided again from scratch (the cold answer).
        Some(Err(_)) | None => {
            counts.builds.fetch_add(1, Ordering::Relaxed);
            build(paths, &manifest, policy_bytes, options, &measured)?
        }
    };
    let inputs = SummaryInputs {
        read_to: [indexed.marks[0].read.offset, indexed.marks[1].read.offset],
        manifest: indexed.manifest.clone(),
        default_cap,
        extension,
        approvals: approvals.clone(),
    };
    let plan = RunPlan {
        manifest: &manifest,
        index: &indexed.index,
        reservations: &indexed.reservations,
        budget: Budget {
            default_cap,
            extension,
        },
        approvals,
        // A file read up to an unterminated final line may hold an outcome the index took from
        // that line while its mark stayed before it: the marks no longer tell what the index
        // holds, so the summary is counted afresh (hostile review 54, N1: a complete line
        // appended without its line end showed in the entries but not in the counts).
        summary: measured
            .iter()
            .zip(&indexed.marks)
            .all(|(file, mark)| file.size <= mark.read.offset)
            .then_some((&indexed.summary, inputs)),
        outcome_files: &measured,
        read_to: [indexed.marks[0].read, indexed.marks[1].read],
    };
    let result = work(&plan);
    slot.indexed = Some(indexed);
    Ok(result)
}

/// The manifest `RunManifest.import_legacy` gives saved outcomes that have none (facts §11.6):
/// `legacy_import`, unverified source and configuration digests, the saved rows' digest, and
/// each rollout's next attempt after the saved outcomes, numbered as legacy rows are (arrival
/// order per rollout, failures sidecar first). Refused without materialized inputs, and when a
/// saved outcome names a run (`_ng_run_id`): those outcomes lost their manifest, or belong to
/// different runs, and are never imported as legacy.
pub fn legacy_manifest(paths: &SidecarPaths, run_id: &str) -> Result<RunManifest, RunFilesError> {
    if !paths.materialized.is_file() {
        return Err(RunFilesError::Inconsistent(format!(
            "Cannot import saved outcomes without their materialized inputs ({} is missing)",
            paths.materialized.display()
        )));
    }
    let mut tagged = BTreeSet::new();
    for path in [&paths.failures, &paths.output] {
        let Ok(file) = recovery_sidecar::open_regular(path) else {
            continue;
        };
        recovery_core::rows::scan_jsonl::<std::convert::Infallible>(
            file,
            &path.display().to_string(),
            |record| {
                if let Some(id) = record.value.get(recovery_core::rows::RUN_ID_KEY) {
                    tagged.insert(id.as_str().map_or_else(|| id.to_string(), str::to_owned));
                }
                Ok(())
            },
        )
        .map_err(|e| RunFilesError::RowsInvalid(e.to_string()))?;
    }
    match tagged.len() {
        0 => {}
        1 => {
            return Err(RunFilesError::Inconsistent(format!(
                "Saved outcomes beside {} name run {} and lost their manifest: restore it rather than importing them as legacy",
                paths.output.display(),
                tagged.iter().next().map(String::as_str).unwrap_or_default()
            )));
        }
        n => {
            return Err(RunFilesError::Inconsistent(format!(
                "Saved outcomes beside {} belong to {n} different runs: they cannot be imported as one",
                paths.output.display()
            )));
        }
    }
    let digest = runfiles::digest_rows_file(&paths.materialized)
        .map_err(RunFilesError::ManifestUnreadable)?;
    let mut manifest = RunManifest::import_legacy(run_id, digest);
    let measured = [Measured::of(&paths.failures)?, Measured::of(&paths.output)?];
    let indexed = build(
        paths,
        &Arc::new(manifest.clone()),
        None,
        IndexOptions::default(),
        &measured,
    )?;
    for (rollout, newest) in indexed.index.newest_attempts() {
        // A manifest keeps execution numbers up to `MAX_NEXT_ATTEMPT`: one it could not read
        // back is never written (hostile review 46: an attempt 2^63 - 1 imported as 2^63).
        let next = u64::try_from(newest)
            .unwrap_or(0)
            .checked_add(1)
            .filter(|next| *next <= recovery_core::manifest::MAX_NEXT_ATTEMPT)
            .ok_or_else(|| {
                RunFilesError::Inconsistent(format!(
                    "rollout {rollout}: its latest saved attempt {newest} leaves no execution number \
                     after it (the largest a manifest keeps is {})",
                    recovery_core::manifest::MAX_NEXT_ATTEMPT
                ))
            })?;
        manifest.next_attempt.insert(rollout.to_owned(), next);
    }
    Ok(manifest)
}

fn read_manifest(cached: Option<ReadManifest>, path: &Path) -> Result<ReadManifest, RunFilesError> {
    let bytes = match recovery_sidecar::read_regular(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RunFilesError::NoManifest(format!(
                "{} is missing",
                path.display()
            )));
        }
        Err(e) => {
            return Err(RunFilesError::ManifestUnreadable(format!(
                "Cannot read recovery manifest {}: {e}",
                path.display()
            )));
        }
    };
    if let Some(cached) = cached.filter(|c| c.bytes == bytes) {
        return Ok(cached);
    }
    match RunManifest::from_json_bytes(&bytes) {
        Ok(manifest) => Ok(ReadManifest {
            bytes,
            manifest: Arc::new(manifest),
        }),
        Err(e) => Err(RunFilesError::ManifestUnreadable(format!(
            "Cannot read recovery manifest {}: {e}",
            path.display()
        ))),
    }
}

fn outcomes_error(e: OutcomesError) -> RunFilesError {
    RunFilesError::RowsInvalid(e.to_string())
}

/// Indexes a run from scratch.
fn build(
    paths: &SidecarPaths,
    manifest: &Arc<RunManifest>,
    policy_bytes: Option<Vec<u8>>,
    options: IndexOptions,
    measured: &[Measured; 2],
) -> Result<Indexed, RunFilesError> {
    let policy = match &policy_bytes {
        Some(bytes) => ClassificationPolicy::from_json(bytes).map_err(|e| {
            RunFilesError::RowsInvalid(format!("{}: {e}", paths.classification_policy.display()))
        })?,
        None => ClassificationPolicy::default(),
    };
    let unreadable = |e: &dyn std::fmt::Display| {
        RunFilesError::ManifestUnreadable(format!("{}: {e}", paths.materialized.display()))
    };
    // The rows are the ones the manifest recorded, or nothing is planned over them.
    let materialized_digest = runfiles::digest_rows_file(&paths.materialized).map_err(|e| {
        RunFilesError::ManifestUnreadable(format!(
            "Cannot read recovery manifest {} or materialized inputs: {e}",
            paths.manifest.display()
        ))
    })?;
    runfiles::check_materialized_digest(manifest, &materialized_digest, paths)?;
    let identity = FileIdentity::of(&paths.materialized).map_err(|e| unreadable(&e))?;
    let mut reader = Hashing {
        inner: recovery_sidecar::open_regular(&paths.materialized).map_err(|e| unreadable(&e))?,
        hasher: Sha256::new(),
    };
    let rows = read_inventory(
        &mut reader,
        &paths.materialized.display().to_string(),
        threads(),
    )
    .map_err(|e| RunFilesError::RowsInvalid(e.to_string()))?;
    let inventory = Inventory {
        identity,
        sha256: reader.hasher.finalize().into(),
    };
    let invalid = |e: recovery_core::plan::PlanError| RunFilesError::RowsInvalid(e.to_string());
    let index = RunIndex::new(manifest, rows, policy, options.clone()).map_err(invalid)?;
    let reservations = index.reservations(manifest).map_err(invalid)?;
    catch_up(
        Indexed {
            inventory,
            policy_bytes,
            options,
            index,
            marks: [Mark::default(), Mark::default()],
            manifest: manifest.clone(),
            reservations,
            materialized_digest,
            summary: Mutex::default(),
        },
        paths,
        measured,
    )
}

/// Reads what was appended to the outcome files since the marks, up to the measured sizes:
/// the failures sidecar first, then the results file.
fn catch_up(
    mut indexed: Indexed,
    paths: &SidecarPaths,
    measured: &[Measured; 2],
) -> Result<Indexed, RunFilesError> {
    // A legacy import numbers untagged outcomes in reading order, the whole sidecar before the
    // results file: a line appended to the sidecar after results were read would be numbered
    // after them here, but before them by a cold read (hostile review 41: the same files
    // planned two ways). Such a run is read again from the start instead.
    if indexed.index.legacy_import()
        && indexed.marks[1].read.offset > 0
        && measured[0].size > indexed.marks[0].read.offset
    {
        return Err(RunFilesError::Inconsistent(
            "a legacy run's sidecar grew: read again from the start".into(),
        ));
    }
    let mut lines = FileLines {
        failures: measured[0].file.as_ref(),
        results: measured[1].file.as_ref(),
    };
    for (i, (artifact, path)) in [
        (Artifact::Failures, &paths.failures),
        (Artifact::Results, &paths.output),
    ]
    .into_iter()
    .enumerate()
    {
        let file = &measured[i];
        let mark = &indexed.marks[i];
        let read = match &file.file {
            Some(handle) if file.size > mark.read.offset => {
                let mut handle = handle;
                handle
                    .seek(SeekFrom::Start(mark.read.offset))
                    .map_err(|e| io(path, e))?;
                index_outcomes(
                    &mut indexed.index,
                    &indexed.reservations,
                    artifact,
                    handle.take(file.size - mark.read.offset),
                    mark.read,
                    &path.display().to_string(),
                    threads(),
                    &mut lines,
                )
                .map_err(outcomes_error)?
            }
            _ => mark.read,
        };
        indexed.marks[i] = Mark {
            file: file.identity,
            guard: file.guard_before(read.offset),
            read,
        };
    }
    Ok(indexed)
}
