//! The transport's threads and what they share, gathered under one path.
//!
//! - [`Lane`]s move slices: lane *i* owns CQ *i* of every context and QP *i* of every endpoint
//!   (see `lanes`).
//! - The connector ([`run_connector`]) bootstraps endpoints off the lanes, one thread per peer
//!   being connected (none when idle); slices wait in their lane's pending queue while their
//!   endpoint is HANDSHAKING.
//! - The passive side of the handshake is [`Core::handle_bootstrap`], run by the RPC server.
//! - The monitor ([`run_monitor`]) reclaims retired endpoints, handles async events
//!   ([`drain_async_events`]), polls notify completions and updates NIC statistics.
//!
//! [`Core`] is the state all of them share.

pub use super::async_events::drain_async_events;
pub use super::connector::{ConnectorMsg, run_connector};
pub use super::core::{Core, Counters, NicStats, WorkerParams};
pub use super::job::{Job, Slice};
pub use super::lanes::{Lane, LaneMsg, decode_wr_id, encode_wr_id};
pub use super::monitor::run_monitor;
pub use super::notify_index::{NotifyEntry, NotifySink};
