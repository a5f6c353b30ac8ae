//! `RowFacts`: everything the predicates read of a saved row, extracted in one pass.
//!
//! One `Deserialize` implementation serves both sources: raw JSONL bytes (the streaming
//! classifier: fields nobody reads are skipped without being built) and an already parsed
//! [`Value`] (`serde_json::Value` is itself a deserializer), so the two paths cannot disagree.
//!
//! Invariants: any JSON value is accepted at any field (a field of an unexpected type is read the
//! way the predicates would read it from a `Value`: absent, or with its Python truthiness);
//! duplicate keys keep the last value; `null` counts as absent wherever the predicates say so.

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;

/// Scalar visits shared by the visitors: each turns the scalar into a [`Json`] and hands it on.
macro_rules! scalar_visits {
    (|$json:ident| $body:expr) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            let $json = Json::Bool(v);
            $body
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            let $json = Json::Int(v);
            $body
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            let $json = i64::try_from(v).map_or(Json::Float(v as f64), Json::Int);
            $body
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            let $json = Json::Float(v);
            $body
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            let $json = Json::Str(v.to_owned());
            $body
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            let $json = Json::Str(v);
            $body
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            let $json = Json::Null;
            $body
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            let $json = Json::Null;
            $body
        }
    };
}

/// serde_json's private marker of an arbitrary-precision number delivered as a one-entry map.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// A JSON value reduced to what a predicate can ask of a scalar field.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Json {
    #[default]
    Absent,
    Null,
    Bool(bool),
    /// An integer that fits `i64`.
    Int(i64),
    /// Any other number.
    Float(f64),
    Str(String),
    List {
        empty: bool,
    },
    Object {
        empty: bool,
    },
}

impl Json {
    /// Python truthiness.
    pub fn truthy(&self) -> bool {
        match self {
            Json::Absent | Json::Null => false,
            Json::Bool(b) => *b,
            Json::Int(i) => *i != 0,
            Json::Float(f) => *f != 0.0,
            Json::Str(s) => !s.is_empty(),
            Json::List { empty } | Json::Object { empty } => !empty,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A JSON integer (never a bool or a float).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Json::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// A JSON number as `f64`.
    pub fn as_number(&self) -> Option<f64> {
        match self {
            Json::Int(i) => Some(*i as f64),
            Json::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// Present and not null.
    pub fn is_present(&self) -> bool {
        !matches!(self, Json::Absent | Json::Null)
    }

    pub fn is_object(&self) -> bool {
        matches!(self, Json::Object { .. })
    }

    pub fn is_number(&self) -> bool {
        matches!(self, Json::Int(_) | Json::Float(_))
    }

    fn from_number_text(text: &str) -> Json {
        if !text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E'))
            && let Ok(i) = text.parse::<i64>()
        {
            return Json::Int(i);
        }
        text.parse::<f64>()
            .map_or(Json::Float(f64::NAN), Json::Float)
    }
}

/// A captured model call's raw fields (all sources' fields; the source decides which are read).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallFacts {
    pub status_code: Json,
    pub upstream_status_code: Json,
    pub error_category: Json,
    pub failure_events: Vec<EventFacts>,
    pub started_at: Json,
    pub duration_ms: Json,
    pub latency_total_ms: Json,
    /// `response_metadata` (trajectory calls): status code, upstream status code, category.
    pub metadata: Option<(Json, Json, Json)>,
}

/// One failure event (`ng_failure_events` or a call's `failure_events`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventFacts {
    pub failure_id: Json,
    pub failure_kind: Json,
    pub stage: Json,
    pub http_status: Json,
}

/// A response object's facts (`response`, `_ng_failure_partial_response`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseFacts {
    pub output: Json,
    pub status: Json,
    /// `metadata.ng_no_generation`.
    pub no_generation: Json,
    /// `metadata.elapsed_seconds`.
    pub elapsed_seconds: Json,
}

/// The canonical failure record's facts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordFacts {
    pub delivery: Json,
    pub source: Json,
    /// The record's `failure` value, when present and not null.
    pub failure: Option<FailureFacts>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct FailureFacts {
    pub failure_kind: Json,
    pub stage: Json,
}

/// A field holding a mapping: absent/null, another type, or the mapping's facts.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Nested<T> {
    #[default]
    Absent,
    Other(Json),
    Object(T),
}

impl<T> Nested<T> {
    pub fn object(&self) -> Option<&T> {
        match self {
            Nested::Object(t) => Some(t),
            _ => None,
        }
    }
}

/// A field holding a list: the list's items when it is one.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Listed<T> {
    #[default]
    Absent,
    Other(Json),
    List(Vec<T>),
}

impl<T> Listed<T> {
    pub fn list(&self) -> Option<&[T]> {
        match self {
            Listed::List(items) => Some(items),
            _ => None,
        }
    }
}

/// Everything the predicates read of a row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowFacts {
    pub failure_class: Json,
    pub failure_terminal: Json,
    pub failure_record: Nested<RecordFacts>,
    pub failure_counts_as_zero: Json,
    pub failure_class_applied: Json,
    pub keeps_saved_answer: Json,
    pub selected_failure_id: Json,
    pub omitted: Json,
    pub omitted_rollout: Json,
    /// `_ng_unrouted_run_error`: a failed agent run that ended the run, kept as evidence.
    pub unrouted_run_error: Json,
    pub recorded_grade: Json,
    pub rejudge: Json,
    pub failure_kind: Json,
    pub mask_sample: Json,
    pub reward: Json,
    pub elapsed_seconds: Json,
    pub reuse_cached_deliverable: Json,
    pub failure_events: Listed<EventFacts>,
    pub response: Nested<ResponseFacts>,
    pub partial_response: Nested<ResponseFacts>,
    pub collected_calls: Listed<CallFacts>,
    /// `ng_model_call_capture.calls`.
    pub capture_calls: Option<Listed<CallFacts>>,
    /// `ng_trajectory.model_calls`.
    pub trajectory_calls: Option<Listed<CallFacts>>,
}

impl RowFacts {
    /// The facts of a parsed row (any JSON value; a non-object has none).
    pub fn from_value(row: &Value) -> Self {
        Self::deserialize(row).unwrap_or_default()
    }

    /// The facts of one JSONL line, skipping every field nobody reads: `None` when the line is
    /// JSON but not an object.
    pub fn from_line(bytes: &[u8]) -> Result<Option<Self>, String> {
        from_line_with(bytes)
    }
}

/// Visits any JSON value, collecting a map with `on_entry` when it is an object.
trait MapFacts<'de>: Sized + Default {
    /// Reads one entry's value into `self` (or skips it).
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error>;
}

/// Deserializes `T` when the value is an object, else reports its [`Json`] shape.
fn visit_nested<'de, T: MapFacts<'de>, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Result<T, Json>, D::Error> {
    struct NestedVisitor<T>(std::marker::PhantomData<T>);
    impl<'de, T: MapFacts<'de>> Visitor<'de> for NestedVisitor<T> {
        type Value = Result<T, Json>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let Some(first) = map.next_key::<Key<'de>>()? else {
                return Ok(Ok(T::default()));
            };
            if first.as_str() == NUMBER_TOKEN {
                let text: String = map.next_value()?;
                return Ok(Err(Json::from_number_text(&text)));
            }
            let mut facts = T::default();
            let mut key = Some(first);
            while let Some(name) = key {
                facts.entry(name.as_str(), &mut map)?;
                key = map.next_key::<Key<'de>>()?;
            }
            Ok(Ok(facts))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            JsonVisitor.visit_seq(seq).map(Err)
        }
        scalar_visits!(|json| Ok(Err(json)));
    }
    deserializer.deserialize_any(NestedVisitor(std::marker::PhantomData))
}

/// Deserializes a list of `T` (each item a mapping's facts, or defaults for other items).
fn visit_listed<'de, T: MapFacts<'de>, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Listed<T>, D::Error> {
    struct ListVisitor<T>(std::marker::PhantomData<T>);
    impl<'de, T: MapFacts<'de>> Visitor<'de> for ListVisitor<T> {
        type Value = Listed<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element_seed(ItemSeed::<T>(std::marker::PhantomData))? {
                items.push(item);
            }
            Ok(Listed::List(items))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            JsonVisitor.visit_map(map).map(Listed::Other)
        }
        scalar_visits!(|json| Ok(Listed::Other(json)));
    }
    deserializer.deserialize_any(ListVisitor(std::marker::PhantomData))
}

struct ItemSeed<T>(std::marker::PhantomData<T>);

impl<'de, T: MapFacts<'de>> DeserializeSeed<'de> for ItemSeed<T> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<T, D::Error> {
        Ok(visit_nested::<T, D>(deserializer)?.unwrap_or_default())
    }
}

struct NestedSeed<T>(std::marker::PhantomData<T>);

impl<'de, T: MapFacts<'de>> DeserializeSeed<'de> for NestedSeed<T> {
    type Value = Nested<T>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Nested<T>, D::Error> {
        Ok(match visit_nested::<T, D>(deserializer)? {
            Ok(facts) => Nested::Object(facts),
            Err(Json::Null) => Nested::Absent,
            Err(other) => Nested::Other(other),
        })
    }
}

struct ListedSeed<T>(std::marker::PhantomData<T>);

impl<'de, T: MapFacts<'de>> DeserializeSeed<'de> for ListedSeed<T> {
    type Value = Listed<T>;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Listed<T>, D::Error> {
        Ok(match visit_listed::<T, D>(deserializer)? {
            Listed::Other(Json::Null) => Listed::Absent,
            other => other,
        })
    }
}

fn nested<'de, T: MapFacts<'de>, A: MapAccess<'de>>(map: &mut A) -> Result<Nested<T>, A::Error> {
    map.next_value_seed(NestedSeed(std::marker::PhantomData))
}

fn listed<'de, T: MapFacts<'de>, A: MapAccess<'de>>(map: &mut A) -> Result<Listed<T>, A::Error> {
    map.next_value_seed(ListedSeed(std::marker::PhantomData))
}

fn json<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Json, A::Error> {
    map.next_value::<Json>()
}

fn skip<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(|_| ())
}

impl<'de> MapFacts<'de> for RowFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "_ng_failure_class" => self.failure_class = json(map)?,
            "_ng_failure_terminal" => self.failure_terminal = json(map)?,
            "_ng_failure_record" => self.failure_record = nested(map)?,
            "_ng_failure_counts_as_zero" => self.failure_counts_as_zero = json(map)?,
            "_ng_failure_class_applied" => self.failure_class_applied = json(map)?,
            "_ng_keeps_saved_answer" => self.keeps_saved_answer = json(map)?,
            "_ng_selected_failure_id" => self.selected_failure_id = json(map)?,
            "_ng_omitted" => self.omitted = json(map)?,
            "_ng_omitted_rollout" => self.omitted_rollout = json(map)?,
            "_ng_unrouted_run_error" => self.unrouted_run_error = json(map)?,
            "_ng_recorded_grade" => self.recorded_grade = json(map)?,
            "_ng_rejudge" => self.rejudge = json(map)?,
            "failure_kind" => self.failure_kind = json(map)?,
            "mask_sample" => self.mask_sample = json(map)?,
            "reward" => self.reward = json(map)?,
            "elapsed_seconds" => self.elapsed_seconds = json(map)?,
            "reuse_cached_deliverable" => self.reuse_cached_deliverable = json(map)?,
            "ng_failure_events" => self.failure_events = listed(map)?,
            "response" => self.response = nested(map)?,
            "_ng_failure_partial_response" => self.partial_response = nested(map)?,
            "_ng_collected_model_calls" => self.collected_calls = listed(map)?,
            "ng_model_call_capture" => {
                self.capture_calls = match nested::<CaptureCalls, A>(map)? {
                    Nested::Object(holder) => Some(holder.0),
                    _ => None,
                };
            }
            "ng_trajectory" => {
                self.trajectory_calls = match nested::<TrajectoryCalls, A>(map)? {
                    Nested::Object(holder) => Some(holder.0),
                    _ => None,
                };
            }
            _ => skip(map)?,
        }
        Ok(())
    }
}

/// `ng_model_call_capture`: its `calls`.
#[derive(Debug, Clone, Default)]
struct CaptureCalls(Listed<CallFacts>);

impl<'de> MapFacts<'de> for CaptureCalls {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        if key == "calls" {
            self.0 = listed(map)?
        } else {
            skip(map)?
        }
        Ok(())
    }
}

/// `ng_trajectory`: its `model_calls`.
#[derive(Debug, Clone, Default)]
struct TrajectoryCalls(Listed<CallFacts>);

impl<'de> MapFacts<'de> for TrajectoryCalls {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        if key == "model_calls" {
            self.0 = listed(map)?
        } else {
            skip(map)?
        }
        Ok(())
    }
}

impl<'de> MapFacts<'de> for CallFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "status_code" => self.status_code = json(map)?,
            "upstream_status_code" => self.upstream_status_code = json(map)?,
            "error_category" => self.error_category = json(map)?,
            "failure_events" => {
                self.failure_events = match listed::<EventFacts, A>(map)? {
                    Listed::List(events) => events,
                    _ => Vec::new(),
                };
            }
            "started_at" => self.started_at = json(map)?,
            "duration_ms" => self.duration_ms = json(map)?,
            "latency_total_ms" => self.latency_total_ms = json(map)?,
            "response_metadata" => {
                self.metadata = match nested::<StatusFacts, A>(map)? {
                    Nested::Object(StatusFacts(status, upstream, category)) => {
                        Some((status, upstream, category))
                    }
                    _ => None,
                };
            }
            _ => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default)]
struct StatusFacts(Json, Json, Json);

impl<'de> MapFacts<'de> for StatusFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "status_code" => self.0 = json(map)?,
            "upstream_status_code" => self.1 = json(map)?,
            "error_category" => self.2 = json(map)?,
            _ => skip(map)?,
        }
        Ok(())
    }
}

impl<'de> MapFacts<'de> for EventFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "failure_id" => self.failure_id = json(map)?,
            "failure_kind" => self.failure_kind = json(map)?,
            "stage" => self.stage = json(map)?,
            "http_status" => self.http_status = json(map)?,
            _ => skip(map)?,
        }
        Ok(())
    }
}

impl<'de> MapFacts<'de> for ResponseFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "output" => self.output = json(map)?,
            "status" => self.status = json(map)?,
            "metadata" => {
                if let Nested::Object(m) = nested::<MetadataFacts, A>(map)? {
                    self.no_generation = m.0;
                    self.elapsed_seconds = m.1;
                } else {
                    self.no_generation = Json::Absent;
                    self.elapsed_seconds = Json::Absent;
                }
            }
            _ => skip(map)?,
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default)]
struct MetadataFacts(Json, Json);

impl<'de> MapFacts<'de> for MetadataFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "ng_no_generation" => self.0 = json(map)?,
            "elapsed_seconds" => self.1 = json(map)?,
            _ => skip(map)?,
        }
        Ok(())
    }
}

impl<'de> MapFacts<'de> for RecordFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "delivery" => self.delivery = json(map)?,
            "source" => self.source = json(map)?,
            "failure" => {
                self.failure = match nested::<FailureFacts, A>(map)? {
                    Nested::Absent => None,
                    Nested::Other(_) => Some(FailureFacts::default()),
                    Nested::Object(f) => Some(f),
                }
            }
            _ => skip(map)?,
        }
        Ok(())
    }
}

impl<'de> MapFacts<'de> for FailureFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        match key {
            "failure_kind" => self.failure_kind = json(map)?,
            "stage" => self.stage = json(map)?,
            _ => skip(map)?,
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for RowFacts {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(visit_nested::<RowFacts, D>(deserializer)?.unwrap_or_default())
    }
}

/// A map key, borrowed from the input when it has no escapes.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(s) => s,
            Key::Owned(s) => s,
        }
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key::Owned(v))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let empty = seq.next_element::<IgnoredAny>()?.is_none();
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Json::List { empty })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let Some(first) = map.next_key::<Key<'de>>()? else {
            return Ok(Json::Object { empty: true });
        };
        if first.as_str() == NUMBER_TOKEN {
            let text: String = map.next_value()?;
            return Ok(Json::from_number_text(&text));
        }
        map.next_value::<IgnoredAny>()?;
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Json::Object { empty: false })
    }
    scalar_visits!(|json| Ok(json));
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

/// A row's `_ng_task_index` or `_ng_rollout_index`, kept so that equality is JSON equality (as
/// `Value` compares it) while the common case, a plain integer, costs no allocation.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum IndexField {
    #[default]
    Absent,
    /// An integer written in its canonical decimal form.
    Int(i64),
    /// Anything else, as written (boxed: the rare case does not widen every row's facts).
    Other(Box<Value>),
}

impl IndexField {
    /// The integer index (`rows::index`): never a bool, never a float.
    pub fn as_index(&self) -> Option<i64> {
        match self {
            IndexField::Int(i) => Some(*i),
            IndexField::Other(value) => crate::rows::index(Some(value)),
            IndexField::Absent => None,
        }
    }

    /// The field as the row holds it (`None` when absent).
    pub fn to_value(&self) -> Option<Value> {
        match self {
            IndexField::Absent => None,
            IndexField::Int(i) => Some(Value::from(*i)),
            IndexField::Other(value) => Some(Value::clone(value)),
        }
    }

    fn other(value: Value) -> IndexField {
        IndexField::Other(Box::new(value))
    }

    fn from_number_text(text: &str) -> IndexField {
        // A JSON integer token (`-?(0|[1-9][0-9]*)`) is the canonical decimal of its value,
        // except `-0`.
        if text != "-0"
            && let Ok(i) = text.parse::<i64>()
        {
            return IndexField::Int(i);
        }
        match serde_json::from_str::<Value>(text) {
            Ok(value) => IndexField::other(value),
            Err(_) => IndexField::other(Value::String(text.to_owned())),
        }
    }
}

impl<'de> Deserialize<'de> for IndexField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IndexVisitor;
        impl<'de> Visitor<'de> for IndexVisitor {
            type Value = IndexField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IndexField, A::Error> {
                let Some(first) = map.next_key::<Key<'de>>()? else {
                    return Ok(IndexField::other(Value::Object(serde_json::Map::new())));
                };
                if first.as_str() == NUMBER_TOKEN {
                    let text: NumberText = map.next_value()?;
                    return Ok(IndexField::from_number_text(&text.0));
                }
                let mut object = serde_json::Map::new();
                object.insert(first.as_str().to_owned(), map.next_value::<Value>()?);
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    object.insert(key, value);
                }
                Ok(IndexField::other(Value::Object(object)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<IndexField, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<Value>()? {
                    items.push(item);
                }
                Ok(IndexField::other(Value::Array(items)))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<IndexField, E> {
                Ok(IndexField::other(Value::Bool(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<IndexField, E> {
                Ok(IndexField::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IndexField, E> {
                // Built only past `i64::MAX`: an eager default allocated a number text for
                // every index of every row.
                Ok(i64::try_from(v)
                    .map_or_else(|_| IndexField::other(Value::from(v)), IndexField::Int))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<IndexField, E> {
                Ok(IndexField::other(Value::from(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<IndexField, E> {
                Ok(IndexField::other(Value::String(v.to_owned())))
            }
            fn visit_unit<E: de::Error>(self) -> Result<IndexField, E> {
                Ok(IndexField::other(Value::Null))
            }
            fn visit_none<E: de::Error>(self) -> Result<IndexField, E> {
                Ok(IndexField::other(Value::Null))
            }
        }
        deserializer.deserialize_any(IndexVisitor)
    }
}

/// The text of an arbitrary-precision number, borrowed from the input when it can be.
struct NumberText<'de>(std::borrow::Cow<'de, str>);

impl<'de> Deserialize<'de> for NumberText<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;
        impl<'de> Visitor<'de> for TextVisitor {
            type Value = NumberText<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number's text")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(NumberText(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(NumberText(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(NumberText(std::borrow::Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(TextVisitor)
    }
}

/// A row's `_ng_attempt_index`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttemptField {
    #[default]
    Absent,
    /// A JSON integer that is a non-negative `i64`.
    Valid(i64),
    /// Anything else (a negative number, a float, a bool, null, a string...).
    Invalid,
}

impl<'de> Deserialize<'de> for AttemptField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let attempt = |i: Option<i64>| match i {
            Some(a) if a >= 0 => AttemptField::Valid(a),
            _ => AttemptField::Invalid,
        };
        Ok(match IndexField::deserialize(deserializer)? {
            IndexField::Int(i) => attempt(Some(i)),
            // `Value::as_i64` of a number text: "-0" is 0, "1.0" is not an integer.
            IndexField::Other(value) => match *value {
                Value::Number(n) => attempt(n.as_i64()),
                _ => AttemptField::Invalid,
            },
            IndexField::Absent => AttemptField::Absent,
        })
    }
}

/// The identity fields of a row: what its logical rollout id is made of.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IdentityFacts {
    /// `_ng_rollout_id` as written (absent: `None`; boxed, as rows seldom carry one).
    pub rollout_id: Option<Box<Value>>,
    pub task_index: IndexField,
    pub rollout_index: IndexField,
}

impl IdentityFacts {
    /// The logical rollout id (`rows::logical_rollout_id`), written into `buffer` (reused across
    /// rows, so a lookup by id allocates nothing).
    pub fn logical_id<'b>(&self, buffer: &'b mut String) -> Result<&'b str, crate::rows::RowError> {
        use crate::rows::RowError;
        use std::fmt::Write as _;
        buffer.clear();
        match self.rollout_id.as_deref() {
            None | Some(Value::Null) => {}
            Some(Value::String(id)) => {
                crate::rows::check_explicit_id(id)?;
                buffer.push_str(id);
                return Ok(buffer);
            }
            Some(other) => {
                return Err(RowError::InvalidIdentity(format!(
                    "{other} is not a string"
                )));
            }
        }
        match (self.task_index.as_index(), self.rollout_index.as_index()) {
            (Some(task), Some(rollout)) => {
                let _ = write!(buffer, "{task}-{rollout}");
                Ok(buffer)
            }
            _ => Err(RowError::NoIdentity),
        }
    }
}

impl<'de> MapFacts<'de> for IdentityFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        if !self.identity_entry(key, map)? {
            skip(map)?;
        }
        Ok(())
    }
}

impl IdentityFacts {
    /// Reads `key` when it is an identity field; `false` when it is not one.
    fn identity_entry<'de, A: MapAccess<'de>>(
        &mut self,
        key: &str,
        map: &mut A,
    ) -> Result<bool, A::Error> {
        match key {
            crate::rows::ROLLOUT_ID_KEY => {
                self.rollout_id = Some(Box::new(map.next_value::<Value>()?));
            }
            crate::rows::TASK_INDEX_KEY => self.task_index = map.next_value()?,
            crate::rows::ROLLOUT_INDEX_KEY => self.rollout_index = map.next_value()?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The identity fields of one JSONL line (a materialized input row); `None` when the line
    /// is JSON but not an object.
    pub fn from_line(bytes: &[u8]) -> Result<Option<Self>, String> {
        from_line_with(bytes)
    }
}

/// Everything the plan reads of one saved outcome row, in one pass over its bytes.
#[derive(Debug, Clone, Default)]
pub struct OutcomeFacts {
    pub identity: IdentityFacts,
    pub attempt: AttemptField,
    /// `_ng_run_id`: absent (`None`), or its string (`Some(None)` when it is not a string).
    pub run_id: Option<Option<String>>,
    /// `_ng_failure_class` as written (`None` when absent).
    pub failure_class: Option<Value>,
    /// `_ng_failure_record` as written (`None` when absent).
    pub failure_record: Option<Value>,
    pub invalid_judge_response: Json,
    /// `_ng_migrated_invalid_judge_response` is exactly `true`.
    pub migrated_invalid_judge: bool,
    /// `_ng_rejudge.predecessor_sha256` when it is a string: the re-judged outcome names the
    /// saved line it re-judges (the SHA-256 of its exact bytes, as the admission did).
    pub rejudge_of: Option<String>,
    pub facts: RowFacts,
}

impl<'de> MapFacts<'de> for OutcomeFacts {
    fn entry<A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<(), A::Error> {
        if self.identity.identity_entry(key, map)? {
            return Ok(());
        }
        match key {
            crate::rows::ATTEMPT_INDEX_KEY => self.attempt = map.next_value()?,
            crate::rows::RUN_ID_KEY => {
                self.run_id = Some(match map.next_value::<Json>()? {
                    Json::Str(s) => Some(s),
                    _ => None,
                });
            }
            "_ng_failure_class" => {
                let value = map.next_value::<Value>()?;
                self.facts.failure_class = Json::deserialize(&value).unwrap_or_default();
                self.failure_class = Some(value);
            }
            "_ng_failure_record" => {
                let value = map.next_value::<Value>()?;
                self.facts.failure_record = NestedSeed(std::marker::PhantomData)
                    .deserialize(&value)
                    .unwrap_or_default();
                self.failure_record = Some(value);
            }
            "invalid_judge_response" => self.invalid_judge_response = json(map)?,
            "_ng_migrated_invalid_judge_response" => {
                self.migrated_invalid_judge = json(map)? == Json::Bool(true);
            }
            "_ng_rejudge" => {
                let value = map.next_value::<Value>()?;
                self.facts.rejudge = Json::deserialize(&value).unwrap_or_default();
                self.rejudge_of = value
                    .get("predecessor_sha256")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
            }
            _ => self.facts.entry(key, map)?,
        }
        Ok(())
    }
}

impl OutcomeFacts {
    /// The facts of one JSONL line (a saved result or failure); `None` when the line is JSON
    /// but not an object.
    pub fn from_line(bytes: &[u8]) -> Result<Option<Self>, String> {
        from_line_with(bytes)
    }

    /// [`Self::from_line`] into `self` (which must be fresh, [`Default`]); `false` when the line
    /// is JSON but not an object.
    pub fn read_line(&mut self, bytes: &[u8]) -> Result<bool, String> {
        read_line_into(bytes, self)
    }
}

/// One JSONL line's facts of kind `T`, fields nobody reads skipped: `None` for a non-object.
fn from_line_with<T: for<'de> MapFacts<'de>>(bytes: &[u8]) -> Result<Option<T>, String> {
    let mut facts = T::default();
    Ok(read_line_into(bytes, &mut facts)?.then_some(facts))
}

/// Fills `facts` from one JSONL line (in place: the facts of a large row are never moved while
/// they are read); `false` when the line is JSON but not an object.
fn read_line_into<T: for<'de> MapFacts<'de>>(bytes: &[u8], facts: &mut T) -> Result<bool, String> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let result = InPlace(facts)
        .deserialize(&mut deserializer)
        .and_then(|r| deserializer.end().map(|()| r));
    match result {
        Ok(is_object) => Ok(is_object),
        // Rows nested deeper than serde_json's default limit take the checked full parse.
        Err(e) if e.to_string().contains("recursion limit") => {
            *facts = T::default();
            match crate::rows::parse_line(bytes)? {
                value @ Value::Object(_) => InPlace(facts)
                    .deserialize(&value)
                    .map_err(|e| e.to_string()),
                _ => Ok(false),
            }
        }
        Err(e) => Err(crate::rows::line_parse_error(&e)),
    }
}

/// Deserializes a mapping's facts into an existing `T`: `true` when the value was an object.
struct InPlace<'a, T>(&'a mut T);

impl<'de, T: MapFacts<'de>> DeserializeSeed<'de> for InPlace<'_, T> {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        struct IntoVisitor<'a, T>(&'a mut T);
        impl<'de, T: MapFacts<'de>> Visitor<'de> for IntoVisitor<'_, T> {
            type Value = bool;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
                let Some(first) = map.next_key::<Key<'de>>()? else {
                    return Ok(true);
                };
                if first.as_str() == NUMBER_TOKEN {
                    map.next_value::<IgnoredAny>()?;
                    return Ok(false);
                }
                let mut key = Some(first);
                while let Some(name) = key {
                    self.0.entry(name.as_str(), &mut map)?;
                    key = map.next_key::<Key<'de>>()?;
                }
                Ok(true)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<bool, A::Error> {
                JsonVisitor.visit_seq(seq).map(|_| false)
            }
            scalar_visits!(|json| {
                let _ = json;
                Ok(false)
            });
        }
        deserializer.deserialize_any(IntoVisitor(self.0))
    }
}
