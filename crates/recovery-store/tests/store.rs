//! The one integration-test binary of `recovery-store`: one suite, run against a real SQLite
//! file and a real PostgreSQL database (127.0.0.1:5432, a fresh database per run, dropped after).

use recovery_store::*;
use serde_json::json;
use std::sync::Arc;

/// PostgreSQL server of these machines (trust auth); `RR_TEST_POSTGRES_URL` overrides it.
fn postgres_admin_url() -> String {
    std::env::var("RR_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into())
}

/// A fresh PostgreSQL database for one test, dropped when the guard goes.
struct PostgresDatabase {
    admin: sqlx::PgPool,
    name: String,
    url: String,
}

impl PostgresDatabase {
    async fn create() -> Self {
        use sqlx::Executor as _;
        let admin_url = postgres_admin_url();
        let admin = sqlx::PgPool::connect(&admin_url).await.unwrap_or_else(|e| {
            panic!("PostgreSQL must be reachable at {admin_url} for the store suite (start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start): {e}")
        });
        let name = format!("rr_test_{}", recovery_sidecar::new_id());
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create database");
        let base = admin_url
            .rsplit_once('/')
            .map_or(admin_url.as_str(), |(base, _)| base)
            .to_owned();
        Self {
            admin,
            url: format!("{base}/{name}"),
            name,
        }
    }

    async fn drop_database(self) {
        use sqlx::Executor as _;
        let _ = self
            .admin
            .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await;
    }
}

async fn with_each_backend<F, Fut>(suite: F)
where
    F: Fn(Store) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = Store::connect(&format!(
        "sqlite://{}",
        dir.path().join("store.db").display()
    ))
    .await
    .expect("sqlite");
    assert_eq!(sqlite.backend(), Backend::Sqlite);
    suite(sqlite.clone()).await;
    sqlite.close().await;
    let database = PostgresDatabase::create().await;
    let postgres = Store::connect(&database.url).await.expect("postgres");
    assert_eq!(postgres.backend(), Backend::Postgres);
    suite(postgres.clone()).await;
    postgres.close().await;
    database.drop_database().await;
}

fn time(second: u32) -> String {
    format!("2026-11-29T10:00:{second:02}.000000Z")
}

fn run(id: &str, output: &str, second: u32) -> RunRecord {
    RunRecord {
        run_id: id.into(),
        output_path: output.into(),
        source_digest: "s".into(),
        materialized_digest: "m".into(),
        config_digest: "c".into(),
        legacy_import: false,
        identity_overridden: false,
        max_rollout_attempts: Some(3),
        created_at: time(second),
        updated_at: time(second),
        superseded_by: None,
    }
}

/// A run another had already replaced (a rebuild finding a set-aside manifest) is recorded as
/// superseded without touching the output's current run, once: a second insert, or one whose
/// suffixed path is taken, changes nothing.
#[tokio::test]
async fn a_run_recorded_as_already_superseded_leaves_the_current_run_alone() {
    with_each_backend(|store| async move {
        store
            .upsert_run(&run("live", "/data/r.jsonl", 3))
            .await
            .expect("live");
        let old = run("old", "/data/r.jsonl", 1);
        assert!(
            store
                .insert_superseded_run(&old, "live")
                .await
                .expect("insert")
        );
        assert!(
            !store
                .insert_superseded_run(&old, "live")
                .await
                .expect("again")
        );
        let twin = run("twin", "/data/r.jsonl", 2);
        assert!(
            !store
                .insert_superseded_run(&twin, "live")
                .await
                .expect("path taken")
        );
        let recorded = store.get_run("old").await.expect("get").expect("kept");
        assert_eq!(recorded.superseded_by.as_deref(), Some("live"));
        assert_eq!(recorded.output_path, "/data/r.jsonl");
        let current = store
            .find_run_by_output("/data/r.jsonl")
            .await
            .expect("find");
        assert_eq!(
            current.map(|r| (r.run_id, r.superseded_by)),
            Some(("live".into(), None))
        );
        assert_eq!(store.current_owner("old").await.expect("owner"), "live");
    })
    .await;
}

#[tokio::test]
async fn runs_are_recorded_found_and_paged() {
    with_each_backend(|store| async move {
        store
            .upsert_run(&run("r1", "/data/a.jsonl", 1))
            .await
            .expect("insert");
        store
            .upsert_run(&run("r2", "/data/b.jsonl", 2))
            .await
            .expect("insert");
        let mut updated = run("r1", "/data/a.jsonl", 1);
        updated.identity_overridden = true;
        updated.updated_at = time(5);
        store.upsert_run(&updated).await.expect("update");
        assert_eq!(
            store.get_run("r1").await.expect("get"),
            Some(updated.clone())
        );
        assert_eq!(
            store
                .find_run_by_output("/data/b.jsonl")
                .await
                .expect("find")
                .map(|r| r.run_id),
            Some("r2".into())
        );
        assert_eq!(store.get_run("nope").await.expect("get"), None);
        let first = store.list_runs(1, None).await.expect("page");
        assert_eq!(
            first.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
            ["r2"]
        );
        let cursor = Cursor {
            at: first[0].created_at.clone(),
            id: first[0].run_id.clone(),
        };
        let second = store.list_runs(10, Some(&cursor)).await.expect("page");
        assert_eq!(
            second.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
            ["r1"]
        );
        // Another run recorded for a.jsonl takes the path over; r1 stays as superseded history.
        let superseded = store
            .upsert_run(&run("r3", "/data/a.jsonl", 6))
            .await
            .expect("take over");
        assert_eq!(superseded.as_deref(), Some("r1"));
        assert_eq!(
            store
                .find_run_by_output("/data/a.jsonl")
                .await
                .expect("find")
                .map(|r| r.run_id),
            Some("r3".into())
        );
        let old = store.get_run("r1").await.expect("get").expect("kept");
        assert_eq!(old.superseded_by.as_deref(), Some("r3"));
        // The record names the output it wrote; only the row keeps it apart.
        assert_eq!(old.output_path, "/data/a.jsonl");
        let found = store
            .search_runs("/data/a.jsonl", 10, None)
            .await
            .expect("search");
        let found: Vec<(&str, &str, Option<&str>)> = found
            .iter()
            .map(|r| {
                (
                    r.run_id.as_str(),
                    r.output_path.as_str(),
                    r.superseded_by.as_deref(),
                )
            })
            .collect();
        assert!(
            found.contains(&("r1", "/data/a.jsonl", Some("r3")))
                && found.contains(&("r3", "/data/a.jsonl", None)),
            "{found:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn runs_are_searched_by_output_path_with_like_wildcards_taken_literally_and_paged() {
    with_each_backend(|store| async move {
        for (n, (id, output)) in [
            ("under", "/data/exp_a/out.jsonl"),
            ("percent", "/data/exp%a/out.jsonl"),
            ("plain", "/data/expxa/out.jsonl"),
            ("slash", "/data/exp\\a/out.jsonl"),
        ]
        .into_iter()
        .enumerate()
        {
            store
                .upsert_run(&run(id, output, n as u32 + 1))
                .await
                .expect("run");
        }
        let ids = |runs: Vec<RunRecord>| runs.into_iter().map(|r| r.run_id).collect::<Vec<_>>();
        for (text, found) in [
            ("exp_a", vec!["under"]),
            ("exp%a", vec!["percent"]),
            ("exp\\a", vec!["slash"]),
            ("/data/", vec!["slash", "plain", "percent", "under"]),
        ] {
            let runs = store.search_runs(text, 10, None).await.expect("search");
            assert_eq!(ids(runs), found, "{text}");
        }
        let first = store.search_runs("/data/", 2, None).await.expect("page");
        let last = &first[1];
        let cursor = Cursor {
            at: last.created_at.clone(),
            id: last.run_id.clone(),
        };
        let rest = store
            .search_runs("/data/", 10, Some(&cursor))
            .await
            .expect("page");
        assert_eq!(ids(first), ["slash", "plain"]);
        assert_eq!(ids(rest), ["percent", "under"]);
    })
    .await;
}

#[tokio::test]
async fn resume_and_drift_events_are_idempotent_and_queryable() {
    with_each_backend(|store| async move {
        let event = ResumeEvent {
            event_id: "e1".into(),
            run_id: Some("r1".into()),
            output_path: "/data/a.jsonl".into(),
            at: time(1),
            outcome: "refused".into(),
            message: "Cannot resume with incompatible source dataset.".into(),
            reasons: vec!["source_dataset".into()],
            semantic_keys: vec![],
            operational_keys: vec![],
            saved_config_digest: Some("c".into()),
            current_config_digest: Some("d".into()),
            client: Some("collector-1".into()),
        };
        assert!(store.insert_resume_event(&event).await.expect("insert"));
        assert!(
            !store.insert_resume_event(&event).await.expect("again"),
            "the same id is recorded once"
        );
        assert_eq!(
            store.list_resume_events("r1", 10).await.expect("list"),
            vec![event]
        );

        let drift = |id: &str, run: &str, second: u32, keys: &[&str]| DriftEvent {
            event_id: id.into(),
            run_id: run.into(),
            at: time(second),
            saved_config_digest: "c".into(),
            current_config_digest: "d".into(),
            operational_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        };
        let events = [
            drift("d1", "r1", 1, &["servers.a.port", "collection.timeout_s"]),
            drift("d2", "r2", 2, &["collection.timeout_s"]),
            drift("d3", "r1", 3, &["servers.b.host"]),
            drift("d4", "r2", 3, &["servers.a.port"]),
        ];
        for event in &events {
            assert!(store.insert_drift_event(event).await.expect("insert"));
            assert!(!store.insert_drift_event(event).await.expect("replay"));
        }
        let ids = |list: Vec<DriftEvent>| list.into_iter().map(|e| e.event_id).collect::<Vec<_>>();
        let all = DriftFilter {
            limit: 100,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&all).await.expect("all")),
            ["d1", "d2", "d3", "d4"]
        );
        let by_run = DriftFilter {
            run_id: Some("r1".into()),
            limit: 100,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&by_run).await.expect("run")),
            ["d1", "d3"]
        );
        let by_key = DriftFilter {
            key: Some("servers.a.port".into()),
            limit: 100,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&by_key).await.expect("key")),
            ["d1", "d4"]
        );
        let by_time = DriftFilter {
            from: Some(time(2)),
            to: Some(time(3)),
            limit: 100,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&by_time).await.expect("time")),
            ["d2"]
        );
        let page = DriftFilter {
            limit: 2,
            ..Default::default()
        };
        let first = store.query_drift(&page).await.expect("page 1");
        let last = first.last().expect("item");
        let cursor = Cursor::decode(
            &Cursor {
                at: last.at.clone(),
                id: last.event_id.clone(),
            }
            .encode(),
        )
        .expect("cursor");
        let next = DriftFilter {
            after: Some(cursor),
            limit: 2,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&next).await.expect("page 2")),
            ["d3", "d4"]
        );
        assert_eq!(
            store.query_drift(&by_key).await.expect("key")[0],
            events[0],
            "keys and digests round-trip"
        );
        // Newest first, with every filter and paging back to older events.
        let newest = |filter: &DriftFilter| DriftFilter {
            newest_first: true,
            ..filter.clone()
        };
        assert_eq!(
            ids(store.query_drift(&newest(&all)).await.expect("all")),
            ["d4", "d3", "d2", "d1"]
        );
        assert_eq!(
            ids(store.query_drift(&newest(&by_key)).await.expect("key")),
            ["d4", "d1"]
        );
        assert_eq!(
            ids(store.query_drift(&newest(&by_run)).await.expect("run")),
            ["d3", "d1"]
        );
        let latest = store.query_drift(&newest(&page)).await.expect("page 1");
        assert_eq!(ids(latest.clone()), ["d4", "d3"]);
        let oldest_seen = latest.last().expect("item");
        let older = DriftFilter {
            after: Some(Cursor {
                at: oldest_seen.at.clone(),
                id: oldest_seen.event_id.clone(),
            }),
            ..newest(&page)
        };
        assert_eq!(
            ids(store.query_drift(&older).await.expect("page 2")),
            ["d2", "d1"]
        );
    })
    .await;
}

/// The API's pages pass the database's JSON text through (`query_drift_rendered`): for every
/// filter, order and page size they hold exactly the events `query_drift` reads, in its order,
/// as `DriftEvent` serializes them, and a cursor exactly when another event follows, which
/// walks every event once.
#[tokio::test]
async fn rendered_drift_pages_hold_what_query_drift_reads_and_page_through_every_event() {
    with_each_backend(|store| async move {
        let keys = [
            "servers.a.port",
            "servers.a.\"quoted\".port",
            "servers.d.tab\tand\nnewline.\u{1}",
            "servers.c.naïve_ポート.url",
        ];
        let mut events = Vec::new();
        for n in 0..23u32 {
            let event = DriftEvent {
                event_id: format!("{:032x}", n * 7919 % 23),
                run_id: format!("r{}", n % 3),
                // Several events share a second: the id orders them.
                at: time(n / 4),
                saved_config_digest: format!("sha256:{n:064x}"),
                current_config_digest: "sha256:\"odd\\digest\"".into(),
                operational_keys: keys[..(n as usize % keys.len()) + 1]
                    .iter()
                    .map(|k| (*k).to_owned())
                    .collect(),
            };
            assert!(store.insert_drift_event(&event).await.expect("insert"));
            events.push(event);
        }
        let filters = [
            DriftFilter::default(),
            DriftFilter {
                run_id: Some("r1".into()),
                ..Default::default()
            },
            DriftFilter {
                key: Some(keys[2].into()),
                ..Default::default()
            },
            DriftFilter {
                from: Some(time(1)),
                to: Some(time(4)),
                ..Default::default()
            },
        ];
        for filter in filters {
            for newest_first in [false, true] {
                let all = DriftFilter {
                    limit: 1000,
                    newest_first,
                    ..filter.clone()
                };
                let expected = store.query_drift(&all).await.expect("all");
                assert!(!expected.is_empty(), "{all:?}");
                for limit in [1, 2, 5, 1000] {
                    let mut walked: Vec<DriftEvent> = Vec::new();
                    let mut after = None;
                    loop {
                        let filter = DriftFilter {
                            limit,
                            after: after.clone(),
                            ..all.clone()
                        };
                        let page = store.query_drift_rendered(&filter).await.expect("page");
                        let read: Vec<DriftEvent> =
                            serde_json::from_str(&page.events_json).expect("JSON events");
                        let queried = store.query_drift(&filter).await.expect("query");
                        assert_eq!(read, queried, "{filter:?}");
                        assert_eq!(
                            page.events_json,
                            serde_json::to_string(&queried).expect("json"),
                            "written as DriftEvent serializes: {filter:?}"
                        );
                        walked.extend(read);
                        match page.next.clone() {
                            Some(cursor) => {
                                let last = walked.last().expect("a page before a cursor");
                                assert_eq!((&cursor.at, &cursor.id), (&last.at, &last.event_id));
                                after = Some(cursor);
                            }
                            None => break,
                        }
                    }
                    assert_eq!(walked, expected, "limit {limit}: {all:?}");
                }
            }
        }
    })
    .await;
}

fn drift(id: &str, run_id: &str, second: u32) -> DriftEvent {
    DriftEvent {
        event_id: id.into(),
        run_id: run_id.into(),
        at: time(second),
        saved_config_digest: "c".into(),
        current_config_digest: "d".into(),
        operational_keys: vec!["servers.a.port".into()],
    }
}

/// Pages are kept between requests (`driftpages.rs`): the same page is answered from memory
/// while the history is unchanged, and built again after any event is inserted (whatever its
/// filter: the version is the whole history's) or the history is numbered anew.
#[tokio::test]
async fn a_drift_page_is_answered_again_only_while_the_history_is_unchanged() {
    with_each_backend(|store| async move {
        for n in 0..5 {
            store
                .insert_drift_event(&drift(&format!("e{n}"), "r1", n))
                .await
                .expect("insert");
        }
        let filter = DriftFilter {
            run_id: Some("r1".into()),
            limit: 1000,
            newest_first: true,
            ..Default::default()
        };
        let first = store.query_drift_rendered(&filter).await.expect("page");
        let again = store.query_drift_rendered(&filter).await.expect("page");
        assert!(
            Arc::ptr_eq(&first, &again),
            "an unchanged history's page is kept"
        );
        // An event of another run changes the version, not the page's events.
        store
            .insert_drift_event(&drift("other", "r2", 9))
            .await
            .expect("insert");
        let after_other = store.query_drift_rendered(&filter).await.expect("page");
        assert!(
            !Arc::ptr_eq(&first, &after_other),
            "built again after an insert"
        );
        assert_eq!(after_other.events_json, first.events_json);
        store
            .insert_drift_event(&drift("late", "r1", 2))
            .await
            .expect("insert");
        let after_late = store.query_drift_rendered(&filter).await.expect("page");
        let read: Vec<DriftEvent> = serde_json::from_str(&after_late.events_json).expect("JSON");
        assert_eq!(read, store.query_drift(&filter).await.expect("query"));
        assert!(read.iter().any(|e| e.event_id == "late"), "{read:?}");
        store.renumber_drift_followers().await.expect("renumber");
        let renumbered = store.query_drift_rendered(&filter).await.expect("page");
        assert!(
            !Arc::ptr_eq(&after_late, &renumbered),
            "a new epoch is a new history"
        );
        assert_eq!(renumbered.events_json, after_late.events_json);
    })
    .await;
}

/// Read-your-writes through the kept pages: 8 writers each insert events one by one and, after
/// each, read the page every writer shares (one run, newest first); the event just inserted is
/// always in it, while the others keep inserting and reading the same page.
#[tokio::test]
async fn concurrent_writers_always_find_their_event_in_the_shared_drift_page() {
    with_each_backend(|store| async move {
        let start = Arc::new(tokio::sync::Barrier::new(8));
        let writers: Vec<_> = (0..8u32)
            .map(|w| {
                let (store, start) = (store.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    let filter = DriftFilter {
                        run_id: Some("hot".into()),
                        limit: 1000,
                        newest_first: true,
                        ..Default::default()
                    };
                    for n in 0..20u32 {
                        let id = format!("w{w}-{n}");
                        store
                            .insert_drift_event(&drift(&id, "hot", (w * 20 + n) % 60))
                            .await
                            .expect("insert");
                        let page = store.query_drift_rendered(&filter).await.expect("page");
                        let read: Vec<DriftEvent> =
                            serde_json::from_str(&page.events_json).expect("JSON");
                        assert!(read.iter().any(|e| e.event_id == id), "{id} missing");
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.await.expect("writer");
        }
        let filter = DriftFilter {
            run_id: Some("hot".into()),
            limit: 1000,
            ..Default::default()
        };
        let page = store.query_drift_rendered(&filter).await.expect("page");
        let read: Vec<DriftEvent> = serde_json::from_str(&page.events_json).expect("JSON");
        assert_eq!(read.len(), 160);
    })
    .await;
}

/// Replicas on one PostgreSQL database keep pages each: an event another replica inserted is in
/// the next page this one answers (the version is read from the database, not kept in memory).
#[tokio::test]
async fn a_drift_page_kept_by_one_replica_shows_what_another_replica_inserted() {
    let database = PostgresDatabase::create().await;
    let one = Store::connect(&database.url).await.expect("one");
    let other = Store::connect(&database.url).await.expect("other");
    one.insert_drift_event(&drift("first", "r", 1))
        .await
        .expect("insert");
    let filter = DriftFilter {
        limit: 10,
        ..Default::default()
    };
    let before = one.query_drift_rendered(&filter).await.expect("page");
    assert!(Arc::ptr_eq(
        &before,
        &one.query_drift_rendered(&filter).await.expect("page")
    ));
    other
        .insert_drift_event(&drift("second", "r", 2))
        .await
        .expect("insert");
    let after = one.query_drift_rendered(&filter).await.expect("page");
    let read: Vec<DriftEvent> = serde_json::from_str(&after.events_json).expect("JSON");
    assert_eq!(
        read.iter().map(|e| e.event_id.as_str()).collect::<Vec<_>>(),
        ["first", "second"]
    );
    one.close().await;
    other.close().await;
    database.drop_database().await;
}

#[tokio::test]
async fn drift_keys_come_back_as_written_whatever_characters_they_hold() {
    with_each_backend(|store| async move {
        let keys = vec![
            "servers.a.\"quoted\".port".to_owned(),
            "servers.b\\slash.host".to_owned(),
            "servers.c.naïve_ポート.url".to_owned(),
            "servers.d.tab\tand\nnewline.\u{1}".to_owned(),
            "[\"looks\", \"like\", \"json\"]".to_owned(),
        ];
        let event = DriftEvent {
            event_id: "odd".into(),
            run_id: "r1".into(),
            at: time(1),
            saved_config_digest: "c".into(),
            current_config_digest: "d".into(),
            operational_keys: keys.clone(),
        };
        assert!(store.insert_drift_event(&event).await.expect("insert"));
        let page = DriftFilter {
            limit: 10,
            ..Default::default()
        };
        assert_eq!(
            store.query_drift(&page).await.expect("query"),
            std::slice::from_ref(&event)
        );
        let by_key = DriftFilter {
            key: Some(keys[2].clone()),
            limit: 10,
            ..Default::default()
        };
        assert_eq!(
            store.query_drift(&by_key).await.expect("by key"),
            std::slice::from_ref(&event)
        );
        let followed = store
            .follow_drift(&DriftFollow {
                run_id: None,
                key: None,
                from: None,
                to: None,
                after: 0,
                limit: 10,
            })
            .await
            .expect("follow");
        assert_eq!(
            followed
                .events
                .into_iter()
                .map(|(_, e)| e)
                .collect::<Vec<_>>(),
            [event]
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_grouped_inserts_commit_every_row_once_and_answer_after_their_commit() {
    with_each_backend(|store| async move {
        let start = Arc::new(tokio::sync::Barrier::new(96));
        let tasks: Vec<_> = (0..96u32)
            .map(|i| {
                let (store, start) = (store.clone(), start.clone());
                tokio::spawn(async move {
                    let drift = DriftEvent {
                        event_id: format!("g{i}"),
                        run_id: format!("r{}", i % 4),
                        at: time(i % 60),
                        saved_config_digest: "c".into(),
                        current_config_digest: "d".into(),
                        operational_keys: vec![format!("servers.a{}.port", i % 3)],
                    };
                    let resume = ResumeEvent {
                        event_id: format!("v{i}"),
                        run_id: Some(drift.run_id.clone()),
                        output_path: "/data/a.jsonl".into(),
                        at: drift.at.clone(),
                        outcome: "resume_with_drift".into(),
                        message: String::new(),
                        reasons: vec![],
                        semantic_keys: vec![],
                        operational_keys: drift.operational_keys.clone(),
                        saved_config_digest: Some("c".into()),
                        current_config_digest: Some("d".into()),
                        client: None,
                    };
                    start.wait().await;
                    store
                        .insert_grouped(vec![GroupedRow::Drift(drift), GroupedRow::Resume(resume)])
                        .await
                        .expect("grouped insert");
                    // Answered after the commit: the caller's own rows are visible at once.
                    let mine = DriftFilter {
                        run_id: Some(format!("r{}", i % 4)),
                        limit: 1000,
                        ..Default::default()
                    };
                    let seen = store.query_drift(&mine).await.expect("query");
                    assert!(seen.iter().any(|e| e.event_id == format!("g{i}")));
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        let all = DriftFilter {
            limit: 1000,
            ..Default::default()
        };
        let mut ids: Vec<String> = store
            .query_drift(&all)
            .await
            .expect("all")
            .into_iter()
            .map(|e| e.event_id)
            .collect();
        ids.sort();
        let mut expected: Vec<String> = (0..96).map(|i| format!("g{i}")).collect();
        expected.sort();
        assert_eq!(ids, expected);
        let keyed = DriftFilter {
            key: Some("servers.a1.port".into()),
            limit: 1000,
            ..Default::default()
        };
        assert_eq!(store.query_drift(&keyed).await.expect("key").len(), 32);
        let resumes: usize = resume_event_count(&store).await;
        assert_eq!(resumes, 96);
        // Replaying the same rows through the group commit inserts nothing twice.
        let replay = DriftEvent {
            event_id: "g0".into(),
            run_id: "r0".into(),
            at: time(0),
            saved_config_digest: "c".into(),
            current_config_digest: "d".into(),
            operational_keys: vec!["servers.a0.port".into()],
        };
        store
            .insert_grouped(vec![GroupedRow::Drift(replay)])
            .await
            .expect("replay");
        assert_eq!(store.query_drift(&all).await.expect("all").len(), 96);
    })
    .await;
}

/// A follower pages the recorded order while writers commit events whose times are out of
/// order (as a collector's journal reindexed late, or an event timed before a slow append):
/// it sees every event exactly once, which a time cursor cannot promise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_of_the_recorded_order_sees_every_event_once_while_writers_commit_out_of_time_order()
 {
    with_each_backend(|store| async move {
        const WRITERS: u32 = 8;
        const EACH: u32 = 40;
        let writing = Arc::new(std::sync::atomic::AtomicUsize::new(WRITERS as usize));
        let follower = {
            let (store, writing) = (store.clone(), writing.clone());
            tokio::spawn(async move {
                let mut seen: Vec<String> = Vec::new();
                let mut position = 0;
                loop {
                    // Read whether writers are left before the page: a page read after the
                    // last writer finished sees everything.
                    let done = writing.load(std::sync::atomic::Ordering::SeqCst) == 0;
                    let page = store
                        .follow_drift(&DriftFollow {
                            after: position,
                            limit: 7,
                            ..Default::default()
                        })
                        .await
                        .expect("follow");
                    let full = page.events.len() == 7;
                    for (seq, event) in page.events {
                        assert!(seq > position, "positions ascend");
                        position = seq;
                        seen.push(event.event_id);
                    }
                    if !full {
                        position = position.max(page.head);
                        if done {
                            return seen;
                        }
                        tokio::task::yield_now().await;
                    }
                }
            })
        };
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (store, writing) = (store.clone(), writing.clone());
                tokio::spawn(async move {
                    for i in 0..EACH {
                        // Times run backwards within a writer and interleave across them.
                        let event = DriftEvent {
                            event_id: format!("w{w}-{i}"),
                            run_id: format!("r{w}"),
                            at: time(59 - (i * 3 + w) % 60),
                            saved_config_digest: "c".into(),
                            current_config_digest: "d".into(),
                            operational_keys: vec![format!("servers.a{}.port", i % 2)],
                        };
                        // One transaction each, concurrent with the other writers' (the
                        // group commit would serialise them within this process).
                        store.insert_drift_events(&[event]).await.expect("insert");
                    }
                    writing.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                })
            })
            .collect();
        for writer in writers {
            writer.await.expect("writer");
        }
        let seen = follower.await.expect("follower");
        let unique: std::collections::BTreeSet<&String> = seen.iter().collect();
        assert_eq!(unique.len(), seen.len(), "no event is followed twice");
        assert_eq!(
            seen.len(),
            (WRITERS * EACH) as usize,
            "every event is followed"
        );
        // A replayed event keeps its place: nothing new to follow.
        let head = store
            .follow_drift(&DriftFollow {
                limit: 1,
                ..Default::default()
            })
            .await
            .expect("head")
            .head;
        let replay = store
            .query_drift(&DriftFilter {
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("all");
        assert_eq!(store.insert_drift_events(&replay).await.expect("replay"), 0);
        let after = store
            .follow_drift(&DriftFollow {
                after: head,
                limit: 10,
                ..Default::default()
            })
            .await
            .expect("after");
        assert!(after.events.is_empty());
        assert_eq!(after.head, head);
        // The filters select as the time order's do, in recorded order.
        let filtered = store
            .follow_drift(&DriftFollow {
                run_id: Some("r3".into()),
                key: Some("servers.a1.port".into()),
                from: Some(time(10)),
                to: Some(time(50)),
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("filtered");
        let mut followed: Vec<String> = filtered
            .events
            .iter()
            .map(|(_, e)| e.event_id.clone())
            .collect();
        let expected: Vec<String> = (0..EACH)
            .filter(|i| i % 2 == 1 && (10..50).contains(&(59 - (i * 3 + 3) % 60)))
            .map(|i| format!("w3-{i}"))
            .collect();
        assert_eq!(
            followed, expected,
            "one writer's events, in the order it wrote them"
        );
        followed.sort();
        let mut by_time: Vec<String> = store
            .query_drift(&DriftFilter {
                run_id: Some("r3".into()),
                key: Some("servers.a1.port".into()),
                from: Some(time(10)),
                to: Some(time(50)),
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("by time")
            .into_iter()
            .map(|e| e.event_id)
            .collect();
        by_time.sort();
        assert_eq!(followed, by_time);
    })
    .await;
}

#[tokio::test]
async fn a_batch_with_repeats_and_known_events_numbers_each_new_event_once_in_the_order_given() {
    with_each_backend(|store| async move {
        let drift = |id: &str, second: u32| DriftEvent {
            event_id: id.into(),
            run_id: "r1".into(),
            at: time(second),
            saved_config_digest: "c".into(),
            current_config_digest: "d".into(),
            operational_keys: vec!["servers.a.port".into()],
        };
        let known = drift("known", 30);
        assert_eq!(
            store
                .insert_drift_events(std::slice::from_ref(&known))
                .await
                .expect("known"),
            1
        );
        let head = |store: Store| async move {
            store
                .follow_drift(&DriftFollow {
                    limit: 1,
                    ..Default::default()
                })
                .await
                .expect("head")
                .head
        };
        let before = head(store.clone()).await;
        // Later in time first: the recorded order is the order given, not the time order.
        // "late" is later than every event known (new without a lookup); "same time" shares
        // the latest known time (looked up: new); "early" is earlier (looked up: new).
        let batch = [
            drift("late", 50),
            known,
            drift("same time", 30),
            drift("early", 10),
            drift("late", 50),
        ];
        assert_eq!(store.insert_drift_events(&batch).await.expect("batch"), 3);
        let followed = store
            .follow_drift(&DriftFollow {
                after: before,
                limit: 10,
                ..Default::default()
            })
            .await
            .expect("follow");
        let ids: Vec<&str> = followed
            .events
            .iter()
            .map(|(_, e)| e.event_id.as_str())
            .collect();
        assert_eq!(
            ids,
            ["late", "same time", "early"],
            "each new event once, as given"
        );
        assert_eq!(followed.head, before + 3);
    })
    .await;
}

/// Batches cut into several statements (SQLite: 500 events and 1,000 keys each; a full
/// statement's text is built once and used again; a chunk later than every recorded event, in
/// time order, is numbered by reading it back, any other by looking each event up): every event
/// and every key of each batch lands once, whatever statement it fell in, numbered in the order
/// given, also where a later chunk is out of time order or earlier than events known.
#[tokio::test]
async fn batches_of_several_statements_record_every_event_and_key_once_in_the_order_given() {
    with_each_backend(|store| async move {
        let drift_as = |n: usize, id: String| DriftEvent {
            event_id: id,
            run_id: format!("r{}", n % 3),
            at: format!("2026-11-29T10:00:00.{n:06}Z"),
            saved_config_digest: "a".repeat(64),
            current_config_digest: "b".repeat(64),
            operational_keys: if n % 2 == 0 {
                vec!["servers.a.port".into(), format!("servers.k{n}.port")]
            } else {
                vec!["servers.a.port".into()]
            },
        };
        let drift = |n: usize| drift_as(n, format!("{n:032x}"));
        let early = |n: usize| drift_as(n, format!("early-{n}"));
        // 2,500 events and 3,750 keys: five full event statements; three full key statements,
        // one partial.
        let first: Vec<DriftEvent> = (0..2_500).map(drift).collect();
        // The first 500 again, then 2,000 new in time order.
        let second: Vec<DriftEvent> = (0..500).chain(2_500..4_500).map(drift).collect();
        // 1,000 new in time order, then 1,000 later ones in reverse time order.
        let third: Vec<DriftEvent> = (4_500..5_500)
            .chain((5_501..6_501).rev())
            .map(drift)
            .collect();
        // 1,000 new in time order, then 1,100 new ones earlier than every event known (a
        // partial statement last).
        let fourth: Vec<DriftEvent> = (7_000..8_000)
            .map(drift)
            .chain((0..1_100).map(early))
            .collect();
        for (batch, new) in [
            (&first, 2_500),
            (&second, 2_000),
            (&third, 2_000),
            (&fourth, 2_100),
        ] {
            assert_eq!(store.insert_drift_events(batch).await.expect("insert"), new);
        }
        let mut followed = Vec::new();
        let mut after = 0;
        loop {
            let page = store
                .follow_drift(&DriftFollow {
                    after,
                    limit: 1000,
                    ..Default::default()
                })
                .await
                .expect("follow");
            let Some((position, _)) = page.events.last() else {
                break;
            };
            after = *position;
            followed.extend(page.events.into_iter().map(|(_, e)| e.event_id));
        }
        let expected: Vec<String> = (0..4_500)
            .map(|n| format!("{n:032x}"))
            .chain(third.iter().chain(&fourth).map(|e| e.event_id.clone()))
            .collect();
        assert_eq!(followed.len(), expected.len(), "every event once");
        assert_eq!(followed, expected, "every event once, in the order given");
        let common = store
            .query_drift(&DriftFilter {
                key: Some("servers.a.port".into()),
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("common key");
        assert_eq!(common.len(), 1000, "a full page of the key every event has");
        for n in [0, 998, 1_000, 1_998, 2_000, 2_498, 2_500, 4_498, 6_500] {
            let key = format!("servers.k{n}.port");
            let found = store
                .query_drift(&DriftFilter {
                    key: Some(key.clone()),
                    limit: 10,
                    ..Default::default()
                })
                .await
                .expect("rare key");
            let mut ids: Vec<String> = found.into_iter().map(|e| e.event_id).collect();
            ids.sort();
            let mut wanted = vec![format!("{n:032x}")];
            if n < 1_100 {
                wanted.push(format!("early-{n}"));
            }
            wanted.sort();
            assert_eq!(ids, wanted, "{key}");
        }
    })
    .await;
}

/// Resume events recorded over the four runs of the grouped-insert test.
async fn resume_event_count(store: &Store) -> usize {
    let mut total = 0;
    for run in 0..4 {
        total += store
            .list_resume_events(&format!("r{run}"), 1000)
            .await
            .expect("list")
            .len();
    }
    total
}

#[tokio::test]
async fn approvals_extensions_resubmits_and_rejudgments_keep_their_rules() {
    with_each_backend(|store| async move {
        let approval = |id: &str, attempt: i64| Approval {
            approval_id: id.into(),
            run_id: "r1".into(),
            at: time(1),
            by: "operator".into(),
            reason: "verifier lost the artifact".into(),
            task_index: 3,
            rollout_index: 0,
            attempt_index: attempt,
            consumed_by_attempt: None,
            revoked_at: None,
        };
        assert!(
            store
                .insert_approval(&approval("a1", 1))
                .await
                .expect("insert")
        );
        assert!(
            !store
                .insert_approval(&approval("a1", 1))
                .await
                .expect("replay")
        );
        assert!(
            store
                .insert_approval(&approval("a2", 2))
                .await
                .expect("insert")
        );
        // The same id in another run is that run's own approval (hostile review 41: keyed by
        // id alone, it was never recorded, so it could be neither listed nor revoked).
        let mut elsewhere = approval("a1", 1);
        elsewhere.run_id = "r2".into();
        assert!(store.insert_approval(&elsewhere).await.expect("insert"));
        assert!(
            store
                .consume_approval("r1", "a1", 2)
                .await
                .expect("consume")
        );
        assert!(
            !store
                .revoke_approval("r1", "a1", &time(2))
                .await
                .expect("revoke"),
            "a used approval cannot be revoked"
        );
        assert!(
            store
                .revoke_approval("r1", "a2", &time(2))
                .await
                .expect("revoke")
        );
        assert!(
            !store
                .consume_approval("r1", "a2", 3)
                .await
                .expect("consume"),
            "a revoked approval is never used"
        );
        let list = store.list_approvals("r1").await.expect("list");
        assert_eq!(
            (list[0].consumed_by_attempt, list[1].revoked_at.as_deref()),
            (Some(2), Some(time(2).as_str()))
        );
        let other = store.list_approvals("r2").await.expect("list");
        assert_eq!(
            (
                other.len(),
                other[0].consumed_by_attempt,
                other[0].revoked_at.as_deref()
            ),
            (1, None, None),
            "another run's approval of the same id is untouched"
        );
        // Recorded again as its journal line says: revoked, or other fields; never once used.
        let mut edited = approval("a2", 5);
        edited.reason = "written again".into();
        assert!(store.restore_approval(&edited).await.expect("restore"));
        assert!(
            !store.restore_approval(&edited).await.expect("restore"),
            "nothing differs now"
        );
        let mut reworded = approval("a1", 1);
        reworded.reason = "reworded".into();
        assert!(
            !store.restore_approval(&reworded).await.expect("restore"),
            "a used approval whose line names the attempt it was used for stays as it was used"
        );
        let list = store.list_approvals("r1").await.expect("list");
        assert_eq!(
            (
                list[1].revoked_at.as_deref(),
                list[1].attempt_index,
                list[1].reason.as_str(),
                list[0].attempt_index,
                list[0].consumed_by_attempt
            ),
            (None, 5, "written again", 1, Some(2))
        );
        // A used approval's line naming another attempt now approves that attempt (the plan
        // honours it): recorded again, unused (hostile review 43: listed as used while the plan
        // approved another rollout with it, and never revocable).
        assert!(
            store
                .restore_approval(&approval("a1", 7))
                .await
                .expect("restore")
        );
        let list = store.list_approvals("r1").await.expect("list");
        assert_eq!(
            (list[0].attempt_index, list[0].consumed_by_attempt),
            (7, None)
        );

        let extension = AttemptExtension {
            event_id: "x1".into(),
            run_id: "r1".into(),
            at: time(1),
            by: "op".into(),
            reason: "outage".into(),
            extend_attempts: 2,
        };
        assert!(store.insert_extension(&extension).await.expect("insert"));
        assert!(!store.insert_extension(&extension).await.expect("replay"));
        assert_eq!(
            store.list_extensions("r1").await.expect("list"),
            vec![extension]
        );
        let resubmit = Resubmit {
            event_id: "s1".into(),
            run_id: "r1".into(),
            at: time(1),
            by: "op".into(),
            line_offset: 12,
        };
        assert!(store.insert_resubmit(&resubmit).await.expect("insert"));
        assert_eq!(
            store.list_resubmits("r1").await.expect("list"),
            vec![resubmit]
        );
        let rejudgment = Rejudgment {
            operation_id: "0".repeat(32),
            run_id: "r1".into(),
            attempt_key: "3-0-a1".into(),
            admitted_at: time(1),
            predecessor_failure_id: "f1".into(),
            predecessor_sha256: "a".repeat(64),
            closed_at: None,
            outcome: None,
        };
        assert!(store.insert_rejudgment(&rejudgment).await.expect("insert"));
        assert!(
            store
                .close_rejudgment(&rejudgment.operation_id, &time(4), "graded")
                .await
                .expect("close")
        );
        assert!(
            !store
                .close_rejudgment(&rejudgment.operation_id, &time(5), "graded")
                .await
                .expect("close twice")
        );
        assert_eq!(
            store.list_rejudgments("r1").await.expect("list")[0]
                .outcome
                .as_deref(),
            Some("graded")
        );
    })
    .await;
}

fn lease(id: &str, holder: &str, expires: u32) -> Lease {
    Lease {
        run_id: "r1".into(),
        lease_id: id.into(),
        holder: holder.into(),
        host: "node-1".into(),
        pid: 4242,
        acquired_at: time(0),
        renewed_at: time(0),
        expires_at: time(expires),
        replica: "replica-a".into(),
    }
}

#[tokio::test]
async fn leases_are_exclusive_until_they_expire_and_takeovers_return_the_previous_holder() {
    with_each_backend(|store| async move {
        assert_eq!(
            store
                .try_acquire_lease(&lease("l1", "collector-a", 10), &time(0))
                .await
                .expect("acquire")
                .lease_id,
            "l1"
        );
        let contender = store
            .try_acquire_lease(&lease("l2", "collector-b", 20), &time(5))
            .await
            .expect("contend");
        assert_eq!(
            (contender.lease_id.as_str(), contender.holder.as_str()),
            ("l1", "collector-a"),
            "a live lease is kept"
        );
        assert!(
            store
                .renew_lease("r1", "l1", &time(6), &time(16))
                .await
                .expect("renew")
        );
        assert!(
            !store
                .renew_lease("r1", "l2", &time(6), &time(16))
                .await
                .expect("renew"),
            "only the holder renews"
        );
        assert!(
            store
                .expired_leases(Some("replica-a"), &time(15))
                .await
                .expect("expired")
                .is_empty()
        );
        assert_eq!(
            store
                .expired_leases(Some("replica-a"), &time(16))
                .await
                .expect("expired")
                .len(),
            1
        );
        assert!(
            !store
                .renew_lease("r1", "l1", &time(17), &time(27))
                .await
                .expect("renew"),
            "an expired lease cannot be renewed"
        );
        let after_expiry = store
            .try_acquire_lease(&lease("l3", "collector-c", 40), &time(17))
            .await
            .expect("acquire");
        assert_eq!(after_expiry.lease_id, "l3", "expiry frees the run");
        let locks = |paths: &[&str]| paths.iter().map(|p| (*p).to_owned()).collect::<Vec<_>>();
        store
            .record_lease_locks("r1", "l3", &locks(&["/d/out_run.lock"]))
            .await
            .expect("locks");
        let previous = store
            .replace_lease(&lease("l4", "operator-takeover", 50))
            .await
            .expect("takeover");
        assert_eq!(previous.map(|l| l.lease_id), Some("l3".into()));
        store
            .record_lease_locks(
                "r1",
                "l4",
                &locks(&["/d/out_run.lock", "/ck/.collector.lock"]),
            )
            .await
            .expect("locks");
        assert_eq!(
            store.lease_locks("r1", "l3").await.expect("locks"),
            locks(&[]),
            "the replaced lease's lock files are forgotten"
        );
        assert!(
            !store.release_lease("r1", "l3").await.expect("release"),
            "the replaced holder no longer holds it"
        );
        assert!(store.release_lease("r1", "l4").await.expect("release"));
        assert_eq!(store.get_lease("r1").await.expect("get"), None);
        assert_eq!(
            store.lease_locks("r1", "l4").await.expect("locks"),
            locks(&[]),
            "a released lease's lock files are forgotten with it"
        );

        // Many contenders at once: exactly one lease is granted.
        let store = Arc::new(store);
        let barrier = Arc::new(tokio::sync::Barrier::new(64));
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    let mine = lease(&format!("c{i}"), &format!("collector-{i}"), 59);
                    let holder = store
                        .try_acquire_lease(&mine, &time(50))
                        .await
                        .expect("contend");
                    holder.lease_id == mine.lease_id
                })
            })
            .collect();
        let mut granted = 0;
        for task in tasks {
            granted += usize::from(task.await.expect("task"));
        }
        assert_eq!(granted, 1, "exactly one of 64 contenders holds the lease");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ids_an_older_release_kept_in_clear_are_kept_as_digests_from_the_next_start() {
    let dir = tempfile::tempdir().expect("dir");
    let sqlite_url = format!("sqlite://{}", dir.path().join("old.db").display());
    let database = PostgresDatabase::create().await;
    // PostgreSQL replicas start together: each converts what is still clear, none fails. An
    // SQLite file has one service process.
    for (url, replicas) in [(sqlite_url.as_str(), 1), (database.url.as_str(), 4)] {
        let store = Store::connect(url).await.expect("store");
        // As an older release recorded them: the id itself.
        let clear = lease("0123456789abcdef0123456789abcdef", "collector-a", 59);
        store
            .try_acquire_lease(&clear, &time(0))
            .await
            .expect("lease");
        store
            .record_lease_locks("r1", &clear.lease_id, &["/data/out_run.lock".to_owned()])
            .await
            .expect("locks");
        store.close().await;
        let starting: Vec<_> = (0..replicas)
            .map(|_| {
                let url = url.to_owned();
                tokio::spawn(async move { Store::connect(&url).await.expect("started") })
            })
            .collect();
        for replica in starting {
            replica.await.expect("replica").close().await;
        }
        for start in ["first", "second"] {
            let store = Store::connect(url).await.expect("reopened");
            let kept = store.get_lease("r1").await.expect("get").expect("lease");
            let digest = lease_digest(&clear.lease_id);
            assert_eq!(kept.lease_id, digest, "{url}: {start} start");
            assert_eq!(
                store.lease_locks("r1", &digest).await.expect("locks"),
                ["/data/out_run.lock"],
                "{url}: {start} start"
            );
            assert_eq!(
                store
                    .lease_locks("r1", &clear.lease_id)
                    .await
                    .expect("locks"),
                Vec::<String>::new()
            );
            store.close().await;
        }
    }
    database.drop_database().await;
}

/// Managed PostgreSQL services require TLS: `sslmode=require` encrypts, `verify-full` checks
/// the server's certificate against `sslrootcert` (or the system's roots) and its name. This
/// machine's server has Debian's self-signed certificate, for `localhost`.
#[tokio::test]
async fn postgresql_is_reached_over_tls_and_its_certificate_is_checked_when_asked() {
    use sqlx::Row as _;
    const CERTIFICATE: &str = "/etc/ssl/certs/ssl-cert-snakeoil.pem";
    let database = PostgresDatabase::create().await;
    let localhost = database.url.replace("@127.0.0.1:", "@localhost:");
    for url in [
        format!("{}?sslmode=require", database.url),
        format!("{localhost}?sslmode=verify-full&sslrootcert={CERTIFICATE}"),
    ] {
        let store = Store::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        store.ping().await.expect("ping");
        let encrypted = sqlx::query(
            "SELECT bool_and(s.ssl) AND count(*) > 0 FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.datname = $1",
        )
        .bind(&database.name)
        .fetch_one(&database.admin)
        .await
        .expect("pg_stat_ssl")
        .get::<bool, _>(0);
        assert!(
            encrypted,
            "{url}: every connection of the store is encrypted"
        );
        store.close().await;
    }
    // Not the name the certificate was made for: refused, saying why.
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={CERTIFICATE}",
        database.url
    );
    let error = Store::connect(&url)
        .await
        .expect_err("another name")
        .to_string();
    assert!(
        error.contains("certificate not valid for name"),
        "{url}: {error}"
    );
    // A file the URL names that is not there: refused naming the parameter and the file.
    let missing = "/nonexistent/root.pem";
    let url = format!("{localhost}?sslmode=verify-full&sslrootcert={missing}");
    let error = Store::connect(&url)
        .await
        .expect_err("no such file")
        .to_string();
    assert!(
        error.contains(&format!("sslrootcert={missing} cannot be read")),
        "{url}: {error}"
    );
    database.drop_database().await;
}

#[tokio::test]
async fn the_audit_log_keeps_operator_actions() {
    with_each_backend(|store| async move {
        let entry = AuditEntry {
            audit_id: "u1".into(),
            at: time(1),
            actor: "operator".into(),
            action: "lease.takeover".into(),
            run_id: Some("r1".into()),
            details: json!({"previous_holder": "collector-a"}),
        };
        store.insert_audit(&entry).await.expect("insert");
        store
            .insert_audit(&entry)
            .await
            .expect("replay is harmless");
        assert_eq!(
            store.list_audit(Some("r1"), 10).await.expect("list"),
            vec![entry.clone()]
        );
        assert_eq!(store.list_audit(None, 10).await.expect("list").len(), 1);
        let counts = store.counts().await.expect("counts");
        assert!(counts.contains(&("audit_log".to_owned(), 1)));
        store.ping().await.expect("ping");
    })
    .await;
}

/// What logs and errors show of a database URL: every password hidden, wherever the URL
/// carries it, and everything else as given.
#[test]
fn a_database_url_is_shown_with_every_password_hidden() {
    for (case, url, shown) in [
        (
            "a password in the user info",
            "postgres://collector:PW1@db:5432/runs",
            "postgres://collector:***@db:5432/runs",
        ),
        (
            "a password as a query parameter",
            "postgres://db/runs?user=collector&password=PW2",
            "postgres://db/runs?user=collector&password=***",
        ),
        (
            "a parameter named otherwise (any case, sslpassword)",
            "postgresql://db/runs?PASSWORD=PW3&sslpassword=PW4&sslmode=require",
            "postgresql://db/runs?PASSWORD=***&sslpassword=***&sslmode=require",
        ),
        (
            "both at once",
            "postgres://u:PW5@db/runs?password=PW6",
            "postgres://u:***@db/runs?password=***",
        ),
        (
            "no password: as given, spaces and all",
            "sqlite:///data/my runs/rollout-recovery.db?mode=rwc",
            "sqlite:///data/my runs/rollout-recovery.db?mode=rwc",
        ),
        (
            "a password holding `@`, `/` and `#` unescaped: hidden up to the last `@`",
            "postgres://user:Sup@r/Secret#Pw8@127.0.0.1:5432/db",
            "postgres://***@127.0.0.1:5432/db",
        ),
        (
            "a password holding `@` unescaped, and one as a parameter",
            "postgres://user:P@W9@db/runs?password=PW10",
            "postgres://***@db/runs?password=***",
        ),
        (
            "a connection string that is no URL",
            "host=db user=collector password=PW7",
            "(a database URL that does not parse; not shown: it may hold a password)",
        ),
    ] {
        assert_eq!(shown_database_url(url), shown, "{case}");
    }
}

/// A database file that is no SQLite database is refused at once, named with the driver's
/// reason, and left as it was.
#[tokio::test]
async fn a_file_that_is_no_database_is_refused_at_once_naming_it() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("rollout-recovery.db");
    let bytes: Vec<u8> = (0..5000u32).map(|n| (n * 7919 % 251) as u8).collect();
    std::fs::write(&path, &bytes).expect("garbage");
    let url = format!("sqlite://{}", path.display());
    let error = tokio::time::timeout(std::time::Duration::from_secs(20), Store::connect(&url))
        .await
        .expect("refused at once, not after the pool's retries")
        .expect_err("no database");
    let message = error.to_string();
    assert!(message.contains("not a database"), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert_eq!(std::fs::read(&path).expect("file"), bytes, "left as it was");
}

/// A URL the store cannot use is refused naming its scheme or the parameter at fault, never
/// echoing the rest: a connection string carries its password anywhere.
#[tokio::test]
async fn an_unsupported_url_is_refused_without_echoing_it() {
    for (url, named) in [
        ("mysql://admin:PWA@localhost/x?password=PWB", "\"mysql\""),
        ("host=localhost user=admin password=PWC", "not a URL"),
        // The driver would log a parameter it ignores with its value: refused first.
        (
            "postgres://127.0.0.1:1/test?user=admin&PASSWORD=PWA",
            "unknown query parameter `PASSWORD`",
        ),
        ("postgres://127.0.0.1:1/test?passwd=PWB", "`passwd`"),
    ] {
        let error = Store::connect(url).await.expect_err("unsupported");
        let message = error.to_string();
        assert!(message.contains(named), "{message}");
        for secret in ["PWA", "PWB", "PWC"] {
            assert!(!message.contains(secret), "{secret} echoed: {message}");
        }
    }
}

/// Applies the migrations of `backend` before `first_new` (by file name) to `url`, as an older
/// release left its database.
async fn migrate_as_release_before(url: &str, backend: &str, first_new: &str) {
    let all = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../migrations/{backend}"));
    let older = tempfile::tempdir().expect("dir");
    for entry in std::fs::read_dir(&all).expect("migrations") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        if name.as_str() < first_new {
            std::fs::copy(&path, older.path().join(&name)).expect("copy");
        }
    }
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(url).await.expect("connect");
    sqlx::migrate::Migrator::new(older.path())
        .await
        .expect("migrator")
        .run(&pool)
        .await
        .expect("older migrations");
    let inserts = [
        "INSERT INTO drift_events (event_id, run_id, at, saved_config_digest, current_config_digest, operational_keys) \
         VALUES ('e1', 'r1', '2026-11-29T10:00:01.000000Z', 'c', 'd', '[\"servers.a.port\"]')",
        "INSERT INTO drift_events (event_id, run_id, at, saved_config_digest, current_config_digest, operational_keys) \
         VALUES ('e2', 'r2', '2026-11-29T10:00:02.000000Z', 'c', 'd', '[\"servers.a.port\",\"x.timeout\"]')",
        "INSERT INTO drift_event_keys (event_id, key, at) VALUES ('e1', 'servers.a.port', '2026-11-29T10:00:01.000000Z')",
        "INSERT INTO drift_event_keys (event_id, key, at) VALUES ('e2', 'servers.a.port', '2026-11-29T10:00:02.000000Z')",
        "INSERT INTO drift_event_keys (event_id, key, at) VALUES ('e2', 'x.timeout', '2026-11-29T10:00:02.000000Z')",
    ];
    for insert in inserts {
        sqlx::query(insert)
            .execute(&pool)
            .await
            .expect("older rows");
    }
    pool.close().await;
}

#[tokio::test]
async fn drift_rows_of_an_older_release_survive_the_time_ordered_tables() {
    let dir = tempfile::tempdir().expect("dir");
    let sqlite_url = format!("sqlite://{}?mode=rwc", dir.path().join("old.db").display());
    let database = PostgresDatabase::create().await;
    for (url, backend) in [
        (sqlite_url.as_str(), "sqlite"),
        (database.url.as_str(), "postgres"),
    ] {
        migrate_as_release_before(url, backend, "0005").await;
        let store = Store::connect(url)
            .await
            .expect("the newer release opens it");
        let ids =
            |events: Vec<DriftEvent>| events.into_iter().map(|e| e.event_id).collect::<Vec<_>>();
        let all = DriftFilter {
            limit: 10,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&all).await.expect("all")),
            ["e1", "e2"],
            "{backend}"
        );
        let keyed = DriftFilter {
            key: Some("x.timeout".into()),
            limit: 10,
            ..Default::default()
        };
        assert_eq!(
            ids(store.query_drift(&keyed).await.expect("key")),
            ["e2"],
            "{backend}"
        );
        // The old rows are followable too, recorded in time order.
        let followed = store
            .follow_drift(&DriftFollow {
                limit: 10,
                ..Default::default()
            })
            .await
            .expect("follow");
        assert_eq!(
            ids(followed.events.into_iter().map(|(_, e)| e).collect()),
            ["e1", "e2"],
            "{backend}"
        );
        // The old rows still refuse duplicates: replaying them inserts nothing.
        let replay = store.query_drift(&all).await.expect("all");
        assert_eq!(
            store.insert_drift_events(&replay).await.expect("replay"),
            0,
            "{backend}"
        );
        store.close().await;
    }
    database.drop_database().await;
}

/// The page size of an SQLite file, read by a plain connection (no store).
async fn sqlite_page_size(url: &str) -> i64 {
    let pool = sqlx::AnyPool::connect(url).await.expect("connect");
    let size: i64 = sqlx::query_scalar("PRAGMA page_size")
        .fetch_one(&pool)
        .await
        .expect("page size");
    pool.close().await;
    size
}

/// A new SQLite database is made of 32 KiB pages (a reindex is faster with them); a database an
/// earlier release made keeps its 4 KiB pages and its rows, and takes new ones.
#[tokio::test]
async fn a_new_sqlite_database_has_large_pages_and_an_older_one_keeps_its_own() {
    let dir = tempfile::tempdir().expect("dir");
    let new_url = format!("sqlite://{}", dir.path().join("new.db").display());
    let store = Store::connect(&new_url).await.expect("new");
    store
        .insert_drift_events(&[drift("n1", "r1", 1)])
        .await
        .expect("insert");
    store.close().await;
    assert_eq!(sqlite_page_size(&new_url).await, 32768);

    let old_url = format!("sqlite://{}?mode=rwc", dir.path().join("old.db").display());
    migrate_as_release_before(&old_url, "sqlite", "0005").await;
    let before = sqlite_page_size(&old_url).await;
    assert_eq!(before, 4096, "an earlier release's default");
    let store = Store::connect(&old_url).await.expect("old");
    store
        .insert_drift_events(&[drift("n1", "r1", 1)])
        .await
        .expect("insert");
    let all = DriftFilter {
        limit: 10,
        ..Default::default()
    };
    let ids: Vec<String> = store
        .query_drift(&all)
        .await
        .expect("all")
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids.len(), 3, "the older rows and the new one: {ids:?}");
    store.close().await;
    assert_eq!(sqlite_page_size(&old_url).await, before);
}

/// On SQLite the store answers a run's record and lease from memory once read (see
/// `rowcache.rs`); whatever concurrent writers do, those answers are what the database holds,
/// as a plain connection to the file (no store, no cache) reads it.
#[tokio::test]
async fn cached_runs_and_leases_are_what_the_database_holds_after_concurrent_writes() {
    let dir = tempfile::tempdir().expect("dir");
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    let store = Arc::new(Store::connect(&url).await.expect("sqlite"));
    let barrier = Arc::new(tokio::sync::Barrier::new(48));
    let mut tasks = Vec::new();
    for i in 0..48u32 {
        let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let run_id = format!("r{}", i % 4);
            for round in 0..20u32 {
                // Readers fill the cache while the others write.
                store.get_run(&run_id).await.expect("get run");
                store.get_lease(&run_id).await.expect("get lease");
                match (i + round) % 4 {
                    // Runs recorded again at one of two outputs: each record supersedes
                    // whichever run held that output.
                    0 => {
                        let output = format!("/data/{}.jsonl", round % 2);
                        let mut record = run(&run_id, &output, round % 60);
                        record.config_digest = format!("c{i}-{round}");
                        store.upsert_run(&record).await.expect("upsert");
                    }
                    1 => {
                        let mut mine = lease(&format!("l{i}-{round}"), "collector", 59);
                        mine.run_id = run_id.clone();
                        store
                            .try_acquire_lease(&mine, &time(round % 60))
                            .await
                            .expect("acquire");
                    }
                    2 => {
                        if let Some(held) = store.get_lease(&run_id).await.expect("get") {
                            store
                                .renew_lease(&run_id, &held.lease_id, &time(1), &time(58))
                                .await
                                .expect("renew");
                        }
                    }
                    _ => {
                        if let Some(held) = store.get_lease(&run_id).await.expect("get") {
                            store
                                .release_lease(&run_id, &held.lease_id)
                                .await
                                .expect("release");
                        }
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    // Each comparison reads the file through a plain connection: no store, no cache.
    let agree = |when: &'static str| {
        let (store, url) = (Arc::clone(&store), url.clone());
        async move {
            let plain = sqlx::AnyPool::connect(&url)
                .await
                .expect("plain connection");
            for n in 0..4 {
                let run_id = format!("r{n}");
                let cached = store.get_run(&run_id).await.expect("cached run").map(|r| {
                    (
                        r.run_id,
                        r.output_path,
                        r.config_digest,
                        r.superseded_by,
                        r.updated_at,
                    )
                });
                let stored: Option<(String, String, String, Option<String>, String)> =
                    sqlx::query_as(
                        // A superseded run's row keeps its output under a suffix its record
                        // does not show.
                        "SELECT run_id, CASE WHEN superseded_by IS NULL THEN output_path \
                         ELSE replace(output_path, '#superseded-by-' || superseded_by, '') END, \
                         config_digest, superseded_by, updated_at FROM runs WHERE run_id = $1",
                    )
                    .bind(&run_id)
                    .fetch_optional(&plain)
                    .await
                    .expect("stored run");
                assert!(stored.is_some(), "{run_id} was recorded");
                assert_eq!(
                    cached, stored,
                    "{when}: {run_id}: the cached record is the database's"
                );
                let stored: Option<Lease> = sqlx::query_as(
                    "SELECT run_id, lease_id, holder, host, pid, acquired_at, renewed_at, expires_at, replica \
                     FROM leases WHERE run_id = $1",
                )
                .bind(&run_id)
                .fetch_optional(&plain)
                .await
                .expect("stored lease");
                assert_eq!(
                    store.get_lease(&run_id).await.expect("cached lease"),
                    stored,
                    "{when}: {run_id}: the cached lease is the database's"
                );
            }
            plain.close().await;
        }
    };
    agree("after the concurrent writes").await;
    // Then each kind of write once, every row cached before it: a takeover (r0 is held
    // after it, whatever the writes above left), a renewal, an adoption, a release, an
    // acquire of the free run.
    let mut taken = lease("takeover", "operator", 59);
    taken.run_id = "r0".into();
    store.replace_lease(&taken).await.expect("takeover");
    agree("after a takeover").await;
    assert!(
        store
            .renew_lease("r0", "takeover", &time(3), &time(57))
            .await
            .expect("renew")
    );
    agree("after a renewal").await;
    assert!(
        store
            .adopt_lease("r0", "takeover", "replica-b", &time(4))
            .await
            .expect("adopt")
    );
    agree("after an adoption").await;
    assert!(
        store
            .release_lease("r0", "takeover")
            .await
            .expect("release")
    );
    agree("after a release").await;
    taken.lease_id = "acquired".into();
    let holder = store
        .try_acquire_lease(&taken, &time(5))
        .await
        .expect("acquire");
    assert_eq!(holder.lease_id, "acquired", "the released run is free");
    agree("after an acquire").await;
    // r1 takes the output r0 holds: r0's record changes too (superseded).
    let output = store
        .get_run("r0")
        .await
        .expect("get")
        .expect("r0")
        .output_path;
    store
        .upsert_run(&run("r1", &output, 59))
        .await
        .expect("supersede");
    agree("after a run superseded another").await;
    store.close().await;
}

/// SQLite: a commit only appends to the write-ahead log; the store's own checkpointer copies the
/// log into the database file beside the writers. 2,000 drift events (well under the commits'
/// own threshold of 64 MB of log) must reach the database file by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_commits_reach_the_database_file_through_the_background_checkpoint() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("store.db");
    let store = Store::connect(&format!("sqlite://{}", path.display()))
        .await
        .expect("sqlite");
    let size = || std::fs::metadata(&path).map_or(0, |m| m.len());
    let before = size();
    let events: Vec<DriftEvent> = (0..2_000)
        .map(|n| DriftEvent {
            event_id: format!("{n:032x}"),
            run_id: "r1".into(),
            at: format!("2026-11-29T10:00:00.{n:06}Z"),
            saved_config_digest: "a".repeat(64),
            current_config_digest: "b".repeat(64),
            operational_keys: vec!["servers.a.sandbox.sandbox_port".into()],
        })
        .collect();
    assert_eq!(
        store.insert_drift_events(&events).await.expect("insert"),
        2_000
    );
    let wanted = before + 256 * 1024;
    // The checkpointer runs on its own clock: wait for its effect, bounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while size() < wanted && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        size() >= wanted,
        "the database file holds {} bytes, {before} before 2,000 events were committed: the log was never checkpointed",
        size()
    );
    store.close().await;
}

/// A PostgreSQL database that cannot be reached at start is named (host and port, never the
/// password) with the driver's reason, not after the pool's silent retries.
#[tokio::test]
async fn an_unreachable_database_is_named_without_its_password() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    for url in [
        format!("postgres://collector:PGSECRET@127.0.0.1:{port}/test"),
        format!("postgres://127.0.0.1:{port}/test?user=collector&password=PGSECRET"),
    ] {
        let Err(error) = Store::connect(&url).await else {
            panic!("{url} connected");
        };
        let message = error.to_string();
        assert!(
            message.starts_with("cannot connect to the database")
                && message.contains(&format!("127.0.0.1:{port}")),
            "{message}"
        );
        assert!(!message.contains("PGSECRET"), "{message}");
    }
}

#[tokio::test]
async fn a_runs_validations_page_newest_first_each_once_even_when_times_are_equal() {
    with_each_backend(|store| async move {
        // Seven validations of r1, three of them at one time (the id breaks the tie), and one of
        // another run that no page of r1 may hold.
        let seconds = [1, 2, 2, 2, 3, 4, 5];
        let event = |n: usize, run: &str, second: u32| ResumeEvent {
            event_id: format!("{run}-e{n}"),
            run_id: Some(run.into()),
            output_path: format!("/data/{run}.jsonl"),
            at: time(second),
            outcome: "reuse".into(),
            message: "Resuming.".into(),
            reasons: vec![],
            semantic_keys: vec![],
            operational_keys: vec![],
            saved_config_digest: Some("c".into()),
            current_config_digest: Some("c".into()),
            client: None,
        };
        let mut recorded: Vec<ResumeEvent> = seconds
            .iter()
            .enumerate()
            .map(|(n, second)| event(n, "r1", *second))
            .collect();
        for e in recorded.iter().chain([&event(9, "r2", 3)]) {
            assert!(store.insert_resume_event(e).await.expect("insert"));
        }
        recorded.sort_by(|a, b| (&b.at, &b.event_id).cmp(&(&a.at, &a.event_id)));

        for size in [1u32, 2, 3, 7, 10] {
            let mut paged = Vec::new();
            let mut before: Option<Cursor> = None;
            loop {
                let page = store
                    .page_resume_events("r1", before.as_ref(), size)
                    .await
                    .expect("page");
                assert!(page.len() <= size as usize, "size {size}");
                let Some(last) = page.last() else { break };
                before = Some(Cursor {
                    at: last.at.clone(),
                    id: last.event_id.clone(),
                });
                paged.extend(page);
            }
            assert_eq!(paged, recorded, "pages of {size}");
        }
    })
    .await;
}
