//! Group commit of journal appends: concurrent appenders each get their line written once,
//! whole, at the offset they are told, in fewer writes than lines.

use recovery_runs::groupcommit::GroupJournals;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_are_each_written_once_whole_at_their_offset_in_shared_writes() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("runs/out_manifest_resume_drift.jsonl");
    let journals = GroupJournals::default();
    let start = Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let (journals, path, start) = (journals.clone(), path.clone(), start.clone());
            tokio::spawn(async move {
                let line = format!("{{\"n\":{i},\"pad\":\"{}\"}}", "x".repeat(i % 37));
                start.wait().await;
                let offset = journals
                    .append(&path, line.clone().into_bytes())
                    .await
                    .expect("append");
                (offset, line)
            })
        })
        .collect();
    let mut answered = Vec::new();
    for task in tasks {
        answered.push(task.await.expect("task"));
    }
    let mut on_disk = recovery_sidecar::read_lines_at(&path).expect("journal");
    assert_eq!(on_disk.len(), 200, "every line once");
    on_disk.sort();
    answered.sort();
    let on_disk: Vec<(u64, String)> = on_disk
        .into_iter()
        .map(|(offset, line)| (offset, String::from_utf8(line).expect("utf-8")))
        .collect();
    assert_eq!(
        on_disk, answered,
        "each line whole at the offset its caller was told"
    );
    assert!(
        journals.writes() < 200,
        "concurrent appends share writes: {} writes for 200 lines",
        journals.writes()
    );
}

#[tokio::test]
async fn a_torn_tail_left_by_a_killed_writer_is_repaired_before_the_next_batch() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("journal.jsonl");
    std::fs::write(&path, b"{\"n\":0}\n{\"n\":1,\"half").expect("torn");
    let journals = GroupJournals::default();
    let offset = journals
        .append(&path, b"{\"n\":2}".to_vec())
        .await
        .expect("append");
    assert_eq!(offset, 8, "the torn tail is truncated away first");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "{\"n\":0}\n{\"n\":2}\n"
    );
    let refused = journals.append(&path, b"two\nlines".to_vec()).await;
    assert!(refused.is_err(), "a line holding a newline is refused");
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "{\"n\":0}\n{\"n\":2}\n",
        "and nothing of its batch is written"
    );
}
