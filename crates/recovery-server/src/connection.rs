//! Answers sent before their request's body was read to its end say `Connection: close`.
//!
//! An answer given without reading the whole body (a caller refused, an unknown path or method,
//! a query refused, a body over the limit) leaves bytes on the connection that the HTTP library
//! will not read: it closes the connection after the answer. Without the header, a client that
//! sends its next request on that connection loses it ("server disconnected without sending a
//! response"), so every such answer says so (CI, and hostile review 42 for 404, 405 and 422).
//! Invariant: an answer whose request body was read to its end (or had none) keeps the
//! connection.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::HeaderValue;
use axum::http::header::CONNECTION;
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

/// The outermost layer: refuses a head larger than the service reads
/// ([`crate::error::oversized_head`]), and tracks whether the request body reached its end.
/// (One layer for both: each `from_fn` layer costs every request a few microseconds.)
pub async fn outermost(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = Arc::new(AtomicBool::new(http_body::Body::is_end_stream(&body)));
    let body = Body::new(Tracked {
        inner: body,
        read: read.clone(),
    });
    let request = Request::from_parts(parts, body);
    let mut response = match crate::error::oversized_head(&request) {
        Some(refused) => refused,
        None => next.run(request).await,
    };
    if !read.load(Ordering::Acquire) {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that records reaching its end.
struct Tracked {
    inner: Body,
    read: Arc<AtomicBool>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
