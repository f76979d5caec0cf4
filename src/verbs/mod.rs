//! The verbs layer (RDMA providers). Populated by the verbs-layer work; empty in this build, so
//! RDMA is reported as unavailable.
