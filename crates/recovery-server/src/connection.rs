//! Answers sent before their request's body was read to its end say `Connection: close`.
//!
//! An answer given without reading the whole body (a caller refused, an unknown path or method,
//! a query refused, a body over the limit) leaves bytes on the connection that the HTTP library
//! will not read: it closes the connection after the answer. Without the header, a client that
//! sends its next request on that connection loses it ("server disconnected without sending a
//! response"), so every such answer says so (CI, and hostile review 42 for 404, 405 and 422).
//! Invariant: an answer whose request body was read to its end (or had none) keeps the
//! connection.
//!
//! The rest of such a body is read and thrown away before the connection closes (a "lingering
//! close", as nginx does), for at most [`LINGER`] and twice the body limit's worth of bytes (so a
//! body refused as too large is read on too, up to twice the limit). A client
//! that writes its whole body before it reads the answer (Python's `urllib`, `http.client`)
//! otherwise has its connection reset while it writes, and reports a broken pipe instead of the
//! 401, 403 or 422 it was sent (hostile review: `urllib` lost every 401 and 403 to a body of
//! 4 MB or more).

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
use std::time::Duration;

/// How long the rest of an unread body is read and thrown away (see the module doc).
pub const LINGER: Duration = Duration::from_secs(10);

/// The outermost layer: refuses a head larger than the service reads
/// ([`crate::error::oversized_head`]), and tracks whether the request body reached its end.
/// (One layer for both: each `from_fn` layer costs every request a few microseconds.)
/// `linger_bytes` bounds what is read and thrown away of a body its answer did not read.
pub async fn outermost(
    axum::extract::State(linger_bytes): axum::extract::State<usize>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let read = Arc::new(AtomicBool::new(http_body::Body::is_end_stream(&body)));
    let body = Body::new(Tracked {
        inner: Some(body),
        read: read.clone(),
        linger_bytes,
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

/// A request body that records reaching its end, and lingers when dropped before it.
struct Tracked {
    /// Always `Some` until dropped.
    inner: Option<Body>,
    read: Arc<AtomicBool>,
    linger_bytes: usize,
}

impl Drop for Tracked {
    /// A body dropped before its end is read on and thrown away on a task of its own (the
    /// answer is not held back: the HTTP library writes it meanwhile, then closes the
    /// connection once the body is dropped for good).
    fn drop(&mut self) {
        let Some(body) = self.inner.take() else {
            return;
        };
        if self.read.load(Ordering::Acquire) || http_body::Body::is_end_stream(&body) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let limit = self.linger_bytes;
        runtime.spawn(async move {
            let _ = tokio::time::timeout(LINGER, discard(body, limit)).await;
        });
    }
}

/// Reads `body` until its end, an error, or past `limit` bytes, keeping nothing.
async fn discard(mut body: Body, limit: usize) {
    let mut seen = 0usize;
    while let Some(Ok(frame)) =
        std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await
    {
        seen = seen.saturating_add(frame.data_ref().map_or(0, Bytes::len));
        if seen > limit {
            return;
        }
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || inner.is_end_stream() {
            this.read.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}
