//! Test helper for the crash test (not shipped behaviour): writes manifests, identity files and
//! drift journal lines through the registry in a loop, printing `ack <id>` after each event is
//! durable, until it is killed.
//!
//! Usage: `crash-writer <root> <database url> <start index>`

use recovery_core::manifest::RunManifest;
use recovery_runs::{Registry, SystemClock};
use recovery_sidecar::Confinement;
use recovery_store::Store;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let root = PathBuf::from(&args[1]);
    let store = Store::connect(&args[2]).await?;
    let start: u64 = args[3].parse()?;
    let registry = Registry::new(
        store,
        Confinement::new([root.clone()])?,
        Arc::new(SystemClock),
        "crash-writer",
    );
    let paths = registry.paths_for(&root.join("runs/out.jsonl"))?;
    let run = registry.lock_creating(&paths).await?;
    let mut stdout = std::io::stdout();
    for i in start.. {
        let mut manifest = RunManifest::create(
            "0123456789abcdef0123456789abcdef",
            "source",
            "rows",
            format!("config-{i}"),
            Some(3),
        );
        manifest.next_attempt.insert("0-0".into(), i + 1);
        // A large identity makes the write window wide enough to be hit by the kill.
        let identity = serde_json::json!({"collection": {"generation": i, "padding": "x".repeat(64 * 1024)}, "servers": {}, "token_id_capture": {}});
        registry
            .write_manifest(&run, &manifest, Some(&identity))
            .await?;
        let event = registry
            .record_drift(
                &run,
                &manifest,
                &format!("current-{i}"),
                &[format!("collection.timeout_{i}")],
            )
            .await?;
        writeln!(stdout, "ack {}", event.event_id)?;
        stdout.flush()?;
    }
    Ok(())
}
