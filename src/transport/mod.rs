//! Transports move the bytes of tasks whose target is another segment.
//!
//! The engine resolves the target descriptor and picks a transport; the transport ends every task
//! it accepts with `TaskState::complete` or `TaskState::fail` within a bounded time.

pub mod rdma;

use std::sync::Arc;

use crate::engine::batch::Task;
use crate::engine::segment::SegmentDesc;
use crate::engine::types::{Notification, TransportKind};
use crate::error::Result;

/// One way of reaching remote segments.
pub trait Transport: Send + Sync {
    /// Which `TRANSPORT_*` this is.
    fn kind(&self) -> TransportKind;

    /// Starts `tasks`, all aimed at the segment described by `target`. Returning an error means
    /// none of them was started; the engine then fails them.
    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()>;

    /// Whether [`Transport::send_notification`] works.
    fn supports_notifications(&self) -> bool {
        false
    }

    /// Delivers a notification to the owner of `target`.
    fn send_notification(&self, target: &SegmentDesc, note: &Notification) -> Result<()> {
        let _ = (target, note);
        Err(crate::error::Error::NotImplemented(format!(
            "{:?} cannot send notifications",
            self.kind()
        )))
    }

    /// Stops workers and waits for them; pending tasks end FAILED.
    fn shutdown(&self) {}
}
