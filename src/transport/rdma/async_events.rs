//! The reaction to a NIC's async events.

use std::sync::atomic::Ordering;

use super::core::Core;
use crate::verbs::{AsyncEventKind, EventElement};

/// Handles every pending async event: QP fatal retires its endpoint, port error or device fatal
/// pauses the context (and retires its endpoints so their work moves to other NICs), port active
/// resumes it.
pub fn drain_async_events(core: &Core) {
    for (nic, ctx) in core.nics().contexts().live() {
        loop {
            let ev = match ctx.poll_async_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("async events of {}: {e}", ctx.name());
                    break;
                }
            };
            let now = core.clock().now();
            match (ev.kind, ev.element) {
                (
                    AsyncEventKind::QpFatal | AsyncEventKind::QpReqErr | AsyncEventKind::QpAccessErr,
                    EventElement::Qp(qpn),
                ) => {
                    if let Some(store) = core.nics().store(nic) {
                        for ep in store.endpoints() {
                            if ep.qp_numbers().contains(&qpn) {
                                tracing::warn!("{}: QP {qpn} fatal, retiring the endpoint", ep.key);
                                // Its work is flushed: the path is suspect, so that work takes
                                // another rail (as after an error completion on it).
                                ep.mark_path_failed();
                                store.remove(&ep, now);
                            }
                        }
                    }
                }
                (AsyncEventKind::PortErr | AsyncEventKind::DeviceFatal, _) => {
                    tracing::warn!("{}: {:?}, pausing the NIC", ctx.name(), ev.kind);
                    ctx.pause();
                    if let Some(store) = core.nics().store(nic) {
                        store.retire_all(now);
                    }
                }
                (AsyncEventKind::PortActive, _) => {
                    tracing::info!("{}: port active again, resuming", ctx.name());
                    ctx.resume();
                }
                (AsyncEventKind::CqErr, _) => {
                    core.counters().cq_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("{}: CQ overrun reported", ctx.name());
                }
                _ => tracing::debug!("{}: async event {:?}", ctx.name(), ev.kind),
            }
        }
    }
}
