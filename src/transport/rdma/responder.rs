//! The passive side of the bootstrap handshake: answers a peer's bootstrap request with the
//! endpoint this side keeps for the peer's NIC.

use std::sync::atomic::Ordering;

use super::bootstrap::{BootstrapDesc, BootstrapResult, split_nic_path};
use super::context::ContextState;
use super::core::Core;
use super::endpoint::{EpState, PeerWire};

/// Answers a bootstrap request (the passive side) on `core`'s NICs: finds the local NIC, gets
/// or creates the endpoint for the sender's NIC path and lets it accept. A retired endpoint is
/// taken out of the store so the peer's next bootstrap meets a fresh one.
pub fn answer_bootstrap(core: &Core, bytes: &[u8]) -> Vec<u8> {
    answer(core, bytes, false).to_bytes()
}

/// Answers a classic Mooncake engine's Connection handshake (its JSON in, ours out): as
/// [`answer_bootstrap`], with an endpoint of as many QPs as the peer sent (a classic peer
/// refuses any other count), and as upstream's passive side does: a connected endpoint that
/// the peer replaced (it restarted) is replaced in the same handshake instead of refused, and
/// a ready acknowledgement is answered. The reply carries upstream's fields only.
pub fn answer_classic(core: &Core, bytes: &[u8]) -> String {
    answer(core, bytes, true).to_classic_json()
}

fn answer(core: &Core, bytes: &[u8], classic: bool) -> BootstrapDesc {
    core.counters().bootstraps_served.fetch_add(1, Ordering::Relaxed);
    let refuse = |r: BootstrapResult, m: String| {
        tracing::debug!("refusing an RDMA bootstrap: {m}");
        BootstrapDesc::refusal(r, m)
    };
    let req = match BootstrapDesc::parse(bytes) {
        Ok(r) => r,
        Err(e) => return refuse(BootstrapResult::Error, e),
    };
    let Some((_, nic)) = split_nic_path(&req.peer_nic_path) else {
        return refuse(BootstrapResult::NoDevice, format!("No device in peer_nic_path {:?}", req.peer_nic_path));
    };
    if split_nic_path(&req.local_nic_path).is_none() {
        return refuse(BootstrapResult::Error, format!("malformed local_nic_path {:?}", req.local_nic_path));
    }
    if req.nonce.is_some() {
        core.connector().learn_tent_peer(&req.local_nic_path);
    }
    let nics = core.nics();
    let Some(nic_id) = nics.contexts().nic_id(nic) else {
        return refuse(BootstrapResult::NoDevice, format!("No device found in local segment: {nic}"));
    };
    let (Some(ctx), Some(store)) = (nics.context(nic_id), nics.store(nic_id)) else {
        return refuse(BootstrapResult::NoDevice, format!("No device found in local segment: {nic}"));
    };
    match ctx.state() {
        ContextState::Enabled => {}
        // Paused after its port went down (or at start with the port down): its endpoints
        // were retired then, and QPs set up now would only fail (ENETUNREACH on rxe). The
        // peer is told the device is down, which also tells it that nothing of its older
        // QPs for this pair can execute here (its fences, fence.rs).
        ContextState::Paused => return refuse(BootstrapResult::NoDevice, format!("Device is paused: {nic}")),
        _ => return refuse(BootstrapResult::NoDevice, format!("Device is down: {nic}")),
    }
    let wire = if classic {
        if req.ready_ack == Some(true) {
            // The acknowledgement a classic active side sends after its QPs are up, when we
            // offered it. We never do (our QPs are up before we reply), but a peer that sends
            // one anyway gets upstream's answer.
            return match store.get(&req.local_nic_path) {
                Some(ep) if ep.connected_to(&req.qp_num) => ep.local_desc(&req.local_nic_path),
                Some(ep) if ep.state() == EpState::Ready => refuse(
                    BootstrapResult::Error,
                    "Received stale RDMA ready ACK with mismatched peer QP numbers".into(),
                ),
                _ => refuse(BootstrapResult::Error, "Received RDMA ready ACK for unconnected endpoint".into()),
            };
        }
        let lanes = core.cfg().num_lanes;
        if req.qp_num.is_empty() || req.qp_num.len() > lanes {
            return refuse(
                BootstrapResult::LaneMismatch,
                format!(
                    "QP count mismatch in peer and local endpoints: the classic peer {} has {} QPs per endpoint, \
                     this engine at most {lanes} (transports/rdma/num_lanes)",
                    req.local_nic_path,
                    req.qp_num.len()
                ),
            );
        }
        PeerWire::Classic(req.qp_num.len())
    } else {
        PeerWire::Tent
    };
    for attempt in 0..2 {
        let now = core.clock().now();
        // Only an upstream peer's offer of a notify QP is taken at once (see
        // `Connector::offers_notify`).
        let upstream_offer = req.notify_qp_num != 0 && req.nonce.is_none();
        let ep = match nics.endpoint(nic_id, &req.local_nic_path, "", wire, || upstream_offer) {
            Ok(Some(ep)) => {
                core.notify().track(&ep);
                ep
            }
            Ok(None) => return refuse(BootstrapResult::NoDevice, format!("No device found in local segment: {nic}")),
            Err(e) => return refuse(BootstrapResult::Error, format!("Cannot allocate endpoint: {e}")),
        };
        if !ep.state().is_live() {
            store.remove(&ep, now);
            continue;
        }
        let was_ready = ep.state() == EpState::Ready;
        let reply = ep.accept(&req, now);
        if reply.outcome() == BootstrapResult::Ok {
            // The peer connects new QPs to us: its older ones for this pair are retired.
            core.fences().record(nic_id, &req.local_nic_path, false);
        }
        // Accepting a notify upgrade creates the channel.
        core.notify().track(&ep);
        if !ep.state().is_live() {
            if was_ready {
                core.counters().retired_on_mismatch.fetch_add(1, Ordering::Relaxed);
            }
            store.remove(&ep, now);
            if classic && attempt == 0 {
                // A classic peer does not bootstrap again after "retired, retry": its own
                // passive side replaces a stale endpoint in the same handshake, so this side
                // does too, with a fresh endpoint of the peer's QP count.
                continue;
            }
        }
        return reply;
    }
    refuse(BootstrapResult::RetiredRetry, "endpoint is being replaced".into())
}
