//! The peer protocol's version, exchanged on every request and ping
//! (`proto/ferrolog/raft/v1/raft.proto`, "Versions").
//!
//! A request carries the sender's version in the gRPC metadata key
//! [`HEADER`]; the receiver refuses any other major version, or a request
//! without one, with `FAILED_PRECONDITION` and a log line naming the peer
//! and both versions. Pings answer with the receiver's version, so the
//! sender also learns of a mismatch and says so in its own log. (The first
//! brokers' protocol, version 0, served another gRPC service name: they
//! and 1.0 brokers answer each other `UNIMPLEMENTED`.)

use std::fmt;
use std::sync::LazyLock;

use ferrolog_proto::raft::peer_client::PeerClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// This build's major version: brokers speak to each other only within one.
pub const MAJOR: u32 = 1;
/// This build's minor version: additive changes within [`MAJOR`]. 1.1 added
/// `PingResponse.opening_floor` (a 1.0 broker leaves it 0, read as "opens
/// nothing", so campaigns toward it are not held back). 1.2 added the
/// `Batch` RPC (`super::batch`; a 1.1 broker answers it `UNIMPLEMENTED`).
/// 1.3 added votes and pre-votes to `Batch` (a 1.2 broker answers such a
/// call as one without a request, and the sender sends its votes singly).
/// 1.4 added `PingResponse.draining` (a broker in a controlled shutdown is
/// no hand-over target; a 1.3 broker never says so, and refuses no
/// hand-over). 1.5 added partition reassignment, partition count increase
/// and decommissioning: the controller requests `reassign_partition`,
/// `cancel_reassignment`, `complete_reassignment`, `create_partitions`,
/// `decommission_broker`, and the metadata commands
/// `reassignment_started`, `_cancelled`, `_completed`,
/// `partitions_created`, `broker_decommissioned`. A 1.4 broker's metadata
/// image would stop at such a command (`crate::metadata::controller::fold`),
/// so the controller refuses them while a live broker answers pings as 1.4
/// or older. 1.6 added brokers that join a running cluster, controller
/// voter changes and batched metadata entries: the controller requests
/// `join_broker` (answered `joined`), `add_controller_voter`,
/// `remove_controller_voter`, `reassign_partitions` and
/// `complete_reassignments` (answered `each`), and the metadata commands
/// `controller_voters_changed` (refused while a 1.5 broker answers, as
/// above) and `batch` (written one command per entry instead while one
/// does). A 1.6 broker that finds a 1.5 controller sends its requests
/// one partition at a time. 1.7 added the controller request `read_index`
/// (answered `read_index`): a broker confirms that its metadata image is
/// current before it says a topic does not exist or deletes a replica. A
/// 1.6 controller would not decode it: while the controller's broker
/// answers pings as 1.6, the asking broker judges from its own caught-up
/// image, as before 1.7. 1.8 added topic
/// configuration: `create_topic.config`, the request `alter_topic_config`,
/// and in the metadata log `topic_created.config` and
/// `topic_config_altered`. The controller refuses them while a live broker
/// answers as 1.7 or older (its image would lack the configuration, or stop
/// at the command), and a 1.8 broker does not forward them to an older
/// controller. 1.9 added control entries in partition logs (frame kind 5,
/// `ferrolog_raft_store::Control`: retention's log start offset); a 1.8
/// follower cannot decode one, so leaders write none while a live broker
/// answers as 1.8 or older. 1.10 added the control entries `Control::Compact`
/// (a compaction target) and `Control::ExpireProducers` and, in the client
/// protocol, records' `offset_delta` and `null_value`; leaders write neither
/// control entry while a live broker answers as 1.9 or older.
pub const MINOR: u32 = 10;
/// The gRPC metadata key carrying the sender's version, `MAJOR.MINOR`.
pub const HEADER: &str = "ferrolog-peer-protocol";
/// A version to announce instead of this build's, set by
/// [`announce_for_tests`] before the broker starts.
static TEST_OVERRIDE: std::sync::OnceLock<Version> = std::sync::OnceLock::new();

/// A peer protocol version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// Incompatible changes bump it.
    pub major: u32,
    /// Additive changes bump it.
    pub minor: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl Version {
    /// Parses `MAJOR.MINOR`; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let (major, minor) = s.trim().split_once('.')?;
        Some(Self { major: major.parse().ok()?, minor: minor.parse().ok()? })
    }

    /// Whether a broker speaking `self` accepts requests from one speaking
    /// `theirs`: the same major version, any minor.
    pub fn accepts(self, theirs: Version) -> bool {
        self.major == theirs.major
    }
}

/// Makes this process announce `v` instead of its build's version: for
/// tests of mixed-version clusters only (the messages do not change). Only
/// the tests' broker program calls it (`tests/src/bin`); the
/// `ferrolog-broker` binary never does. Must run before the broker starts;
/// later calls are ignored.
pub fn announce_for_tests(v: Version) {
    let _ = TEST_OVERRIDE.set(v);
}

static OURS: LazyLock<Version> = LazyLock::new(|| {
    let built = Version { major: MAJOR, minor: MINOR };
    match TEST_OVERRIDE.get() {
        Some(v) => {
            tracing::warn!(version = %v, built = %built, "announcing another peer protocol version (tests only)");
            *v
        }
        None => built,
    }
});

/// The version this broker speaks.
pub fn ours() -> Version {
    *OURS
}

/// Whether this broker sends and serves the `Batch` RPC (1.2 on): a broker
/// told to announce 1.1 for a test acts as a 1.1 broker does.
pub fn speaks_batch() -> bool {
    ours() >= Version { major: 1, minor: 2 }
}

/// Whether this broker sends and serves votes and pre-votes in `Batch`
/// calls (1.3 on): a broker told to announce 1.2 for a test acts as a 1.2
/// broker does.
pub fn speaks_batched_votes() -> bool {
    ours() >= Version { major: 1, minor: 3 }
}

/// The client-side interceptor: stamps every request with [`ours`].
pub type Stamp = fn(Request<()>) -> Result<Request<()>, Status>;
/// The server-side interceptor, [`check`].
pub type Check = fn(Request<()>) -> Result<Request<()>, Status>;

/// [`ours`] as a header value, made once (it is on every request's path).
static STAMP: LazyLock<Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>> =
    LazyLock::new(|| ours().to_string().parse().ok());

fn stamp(mut req: Request<()>) -> Result<Request<()>, Status> {
    let v = STAMP.clone().ok_or_else(|| Status::internal("unencodable protocol version"))?;
    req.metadata_mut().insert(HEADER, v);
    Ok(req)
}

/// A `RaftPeer` client over `channel` whose requests carry this broker's
/// protocol version. Every peer request goes through one of these.
pub fn peer_client(channel: Channel) -> PeerClient<InterceptedService<Channel, Stamp>> {
    PeerClient::with_interceptor(channel, stamp as Stamp)
}

/// Why a request was refused: `Err` names both versions and what to do.
fn refusal(theirs: Option<Version>) -> Option<String> {
    let ours = ours();
    match theirs {
        Some(v) if ours.accepts(v) => None,
        Some(v) => Some(format!(
            "peer protocol {v} is not spoken here: this broker speaks {ours} (brokers talk only within one \
             major version; upgrade one minor version at a time)"
        )),
        None => Some(format!(
            "the request carries no {HEADER} version (protocol 0, the first brokers' JSON protocol): this \
             broker speaks {ours}; upgrade the sending broker"
        )),
    }
}

/// The server-side interceptor: refuses requests of another major version
/// (or none) with `FAILED_PRECONDITION`, and logs each refusal (rate
/// limited per call site by [`crate::logging`]).
///
/// # Errors
/// `FAILED_PRECONDITION` naming both versions.
pub fn check(req: Request<()>) -> Result<Request<()>, Status> {
    let theirs = req.metadata().get(HEADER).and_then(|v| v.to_str().ok()).and_then(Version::parse);
    match refusal(theirs) {
        None => Ok(req),
        Some(why) => {
            let peer = req.remote_addr().map_or_else(|| "unknown".to_owned(), |a| a.to_string());
            tracing::error!(%peer, "refused a peer request: {why}");
            Err(Status::failed_precondition(why))
        }
    }
}

/// Checks the version a peer's ping answer announced (0.0: a broker that
/// does not say, i.e. protocol 0) and logs a mismatch: the peer refuses this
/// broker's requests, and this broker refuses its.
pub fn check_peer(peer: u32, major: u32, minor: u32) -> bool {
    let theirs = Version { major, minor };
    let ok = ours().accepts(theirs);
    if !ok {
        tracing::error!(
            peer,
            theirs = %theirs,
            ours = %ours(),
            "broker {peer} speaks peer protocol {theirs}, this broker {}: they cannot replicate to each other \
             until both run one major version",
            ours()
        );
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_is_not_the_one_version_0_brokers_serve() {
        use tonic::server::NamedService;
        type Server = ferrolog_proto::raft::peer_server::PeerServer<crate::network::RaftPeerServer>;
        // Version 0 served `ferrolog.raft.v1.RaftPeer` and checks no
        // version: under that name it would decode these messages as its
        // own. Under another it answers UNIMPLEMENTED.
        assert_eq!(<Server as NamedService>::NAME, "ferrolog.raft.v1.Peer");
    }

    #[test]
    fn versions_parse_and_only_the_major_must_match() {
        assert_eq!(Version::parse("1.0"), Some(Version { major: 1, minor: 0 }));
        assert_eq!(Version::parse(" 2.17 "), Some(Version { major: 2, minor: 17 }));
        for bad in ["", "1", "1.", ".1", "1.x", "-1.0", "1.0.0"] {
            assert_eq!(Version::parse(bad), None, "{bad}");
        }
        let v1_0 = Version { major: 1, minor: 0 };
        assert!(v1_0.accepts(Version { major: 1, minor: 1 }));
        assert!(Version { major: 1, minor: 1 }.accepts(v1_0));
        assert!(!v1_0.accepts(Version { major: 2, minor: 0 }));
        assert!(!v1_0.accepts(Version { major: 0, minor: 0 }));
    }

    #[test]
    fn a_request_of_another_major_or_none_is_refused_with_both_versions() {
        let with = |v: &str| {
            let mut r = Request::new(());
            r.metadata_mut().insert(HEADER, v.parse().unwrap());
            r
        };
        assert!(check(with(&ours().to_string())).is_ok());
        assert!(check(with(&format!("{}.{}", ours().major, ours().minor + 1))).is_ok());
        let refused = check(with(&format!("{}.0", ours().major + 1))).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert!(
            refused.message().contains(&format!("peer protocol {}.0 is not spoken here", ours().major + 1))
        );
        let none = check(Request::new(())).unwrap_err();
        assert_eq!(none.code(), tonic::Code::FailedPrecondition);
        assert!(none.message().contains("protocol 0"), "{}", none.message());
        let stamped = stamp(Request::new(())).unwrap();
        assert!(check(stamped).is_ok());
    }
}
