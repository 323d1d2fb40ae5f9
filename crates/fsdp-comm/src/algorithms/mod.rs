//! The collectives, run on a group's communication thread over the wire protocol
//! ([`crate::protocol`]): ring algorithms for bandwidth, direct exchanges for latency, rooted
//! collectives and point-to-point messages.

mod direct;
mod p2p;
mod ring;
mod rooted;
