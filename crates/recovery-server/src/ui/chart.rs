//! The drift chart: events over time, stacked by key, drawn by plotters' SVG backend.
//!
//! The SVG holds only bars (plotters draws text only with a font backend, which this service
//! does not carry); the page prints the axes' ranges and the legend as HTML beside it, where a
//! screen reader finds them too.

use plotters::prelude::*;
use recovery_store::DriftEvent;
use std::collections::BTreeMap;

/// Keys shown by name; the rest are stacked as "other keys".
const SHOWN_KEYS: usize = 6;
/// Time buckets across the chart.
const BUCKETS: usize = 24;

/// Colour-blind-safe (Okabe-Ito) colours, one per shown key, then grey for the others.
const COLOURS: [(u8, u8, u8); SHOWN_KEYS + 1] = [
    (0, 114, 178),
    (230, 159, 0),
    (0, 158, 115),
    (204, 121, 167),
    (86, 180, 233),
    (213, 94, 0),
    (153, 153, 153),
];

/// A drawn chart and what the page prints around it.
#[derive(Debug, Clone)]
pub struct DriftChart {
    pub svg: String,
    /// (key, colour as `#rrggbb`, events) for the legend, most frequent first.
    pub legend: Vec<(String, String, usize)>,
    pub first: String,
    pub last: String,
    pub tallest: usize,
}

/// Keys by how many events name them, most first.
pub fn top_keys(events: &[DriftEvent]) -> Vec<(String, usize)> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for key in events.iter().flat_map(|e| e.operational_keys.iter()) {
        *counts.entry(key).or_default() += 1;
    }
    let mut keys: Vec<(String, usize)> =
        counts.into_iter().map(|(k, n)| (k.to_owned(), n)).collect();
    keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    keys
}

fn seconds(at: &str) -> Option<i64> {
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .ok()
        .map(time::OffsetDateTime::unix_timestamp)
}

/// Draws the events (none: no chart).
pub fn drift_chart(events: &[DriftEvent]) -> Option<DriftChart> {
    let times: Vec<i64> = events.iter().filter_map(|e| seconds(&e.at)).collect();
    let (start, end) = (*times.iter().min()?, *times.iter().max()?);
    let width = ((end - start) / BUCKETS as i64).max(1) + 1;
    let shown: Vec<String> = top_keys(events)
        .into_iter()
        .take(SHOWN_KEYS)
        .map(|(k, _)| k)
        .collect();
    // counts[bucket][series]: series SHOWN_KEYS is "other keys".
    let mut counts = vec![[0usize; SHOWN_KEYS + 1]; BUCKETS];
    for event in events {
        let Some(at) = seconds(&event.at) else {
            continue;
        };
        let bucket = (((at - start) / width) as usize).min(BUCKETS - 1);
        for key in &event.operational_keys {
            let series = shown.iter().position(|k| k == key).unwrap_or(SHOWN_KEYS);
            counts[bucket][series] += 1;
        }
    }
    let tallest = counts
        .iter()
        .map(|c| c.iter().sum::<usize>())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 240)).into_drawing_area();
        root.fill(&WHITE).ok()?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .build_cartesian_2d(0..BUCKETS, 0..tallest)
            .ok()?;
        for (bucket, stack) in counts.iter().enumerate() {
            let mut base = 0;
            for (series, n) in stack.iter().enumerate().filter(|(_, n)| **n > 0) {
                let (r, g, b) = COLOURS[series];
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(bucket, base), (bucket + 1, base + n)],
                        RGBColor(r, g, b).filled(),
                    )))
                    .ok()?;
                base += n;
            }
        }
        root.present().ok()?;
    }
    let hex = |(r, g, b): (u8, u8, u8)| format!("#{r:02x}{g:02x}{b:02x}");
    let totals = top_keys(events);
    let mut legend: Vec<(String, String, usize)> = shown
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let n = totals.iter().find(|(k, _)| k == key).map_or(0, |(_, n)| *n);
            (key.clone(), hex(COLOURS[i]), n)
        })
        .collect();
    let others: usize = totals.iter().skip(SHOWN_KEYS).map(|(_, n)| n).sum();
    if others > 0 {
        legend.push(("other keys".into(), hex(COLOURS[SHOWN_KEYS]), others));
    }
    let at = |t: i64| {
        time::OffsetDateTime::from_unix_timestamp(t)
            .map(recovery_sidecar::format_rfc3339)
            .unwrap_or_default()
    };
    Some(DriftChart {
        svg,
        legend,
        first: at(start),
        last: at(end),
        tallest,
    })
}
