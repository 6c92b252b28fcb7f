//! Which brokers answer: each broker pings every registered peer once per
//! Raft heartbeat interval; a broker is alive while its last answer is more
//! recent than the minimum election timeout. One ping per broker pair
//! replaces per-group heartbeats for failure detection (`crate::control::quiesce`).
//!
//! A broker is silent too long when its last answer is older than
//! `dead_after` (the minimum election timeout), or, under load, than
//! [`RTT_FACTOR`] times its recent ping round trip, whichever is longer (at
//! most [`SILENCE_MAX`]): a broker that answers slowly because the machine
//! is saturated is not declared dead (which would start elections and
//! hand-overs, adding load: the storm this avoids), while one whose
//! connection is refused (a killed process) is dead at once.
//!
//! Pings also say which groups the answering broker leads, and when it came
//! back: a broker that restarted (a new boot id) or answers again after
//! being silent is *returned* once it reports its replicas open, and
//! leaders elsewhere wake their groups until each follower there has
//! acknowledged a heartbeat since (`crate::control::quiesce`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

use ferrolog_proto::raft::{PingRequest, PingResponse};
use tokio::sync::watch;

use crate::config::BrokerId;
use crate::metadata::image::MetadataImage;
use crate::network::PeerAddresses;

/// How many round trips of silence, at least, make a broker dead.
pub const RTT_FACTOR: u32 = 4;

/// The longest silence tolerated however slow the round trips.
pub const SILENCE_MAX: Duration = Duration::from_secs(5);

/// What the last answer of one broker said.
#[derive(Debug)]
struct Heard {
    /// When it answered.
    at: Instant,
    /// When the ping it answered was sent (its arrival less its round
    /// trip): what the answer says (`leading`) was true at some time after
    /// this. For a refused ping, when the refusal came.
    asked: Instant,
    /// Smoothed ping round trip (7/8 old + 1/8 new, as TCP's SRTT, RFC 6298).
    rtt: Duration,
    /// A ping was refused (connection refused or reset) after `at`.
    refused: bool,
    /// The groups it leads, sorted, no duplicates: a sorted list, not a
    /// hash set, since each broker's pings bring the whole list ten times
    /// a second (thousands of ids at 10,000 partitions), and building a
    /// set of it for every answer was most of the pings' cost.
    leading: Vec<u64>,
    /// Its boot id (`PingResponse.boot_id`).
    boot_id: u64,
    /// Since when it has answered without a gap, on this boot, with its
    /// replicas open (`None`: not open yet).
    returned_at: Option<Instant>,
    /// The lowest group id it is still opening, 0: none
    /// (`PingResponse.opening_floor`).
    opening_floor: u64,
    /// It is in a controlled shutdown (`PingResponse.draining`).
    draining: bool,
    /// The minor peer protocol version it answered with.
    protocol_minor: u32,
}

/// Last successful ping per broker. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Liveness {
    seen: Arc<Mutex<BTreeMap<BrokerId, Heard>>>,
    dead_after: Arc<Mutex<Duration>>,
    /// When [`Liveness::run`] started pinging.
    started: Arc<Mutex<Option<Instant>>>,
    /// Counts changes of what the pings say about brokers ([`Liveness::changes`]).
    changes: Arc<AtomicU64>,
    /// Groups a broker began or stopped leading, as its pings say, since
    /// [`Liveness::take_stirred`] last took them.
    stirred: crate::groups::Stirred,
    /// The brokers pinged in the last round (the registered ones).
    pinged: Arc<Mutex<Vec<BrokerId>>>,
    /// This broker's id (0 until [`Liveness::run`] starts): its own pings
    /// tell whether it is itself answering late (see [`Judge`]).
    me: Arc<AtomicU32>,
}

/// How the freshness of an answer is judged, for one look at the answers.
#[derive(Clone, Copy, Debug)]
struct Judge {
    dead_after: Duration,
    /// When the last ping this broker answered itself (through its own
    /// listener, like every peer's) was sent.
    self_asked: Option<Instant>,
}

impl Judge {
    /// Whether `h` is recent enough: not refused, and answered within the
    /// silence allowed ([`silence_allowed`]), or answering a ping sent
    /// within that silence of the last ping this broker answered itself
    /// (at most [`SILENCE_MAX`] ago). While this broker answers itself
    /// promptly that is the same rule; while its own answers come late too
    /// (the machine is saturated, or this process stalled), a peer is not
    /// judged by a silence this broker shares. Measured at 5,000
    /// partitions before this: brokers counted each other (and themselves)
    /// dead after 550–650 ms of silence several times a minute, and each
    /// time the followers of the "dead" broker's groups campaigned. A
    /// refused connection (a killed process) is dead at once, and if this
    /// broker's own pings stop being answered at all, a silent peer is
    /// dead after [`SILENCE_MAX`].
    fn fresh(&self, h: &Heard) -> bool {
        if h.refused {
            return false;
        }
        let silent = h.at.elapsed();
        let allowed = silence_allowed(self.dead_after, h.rtt);
        silent < allowed
            || (silent < SILENCE_MAX
                && self.self_asked.is_some_and(|s| s.saturating_duration_since(h.asked) < allowed))
    }
}

impl Default for Liveness {
    fn default() -> Self {
        Self {
            seen: Arc::default(),
            dead_after: Arc::new(Mutex::new(Duration::from_secs(1))),
            started: Arc::default(),
            changes: Arc::default(),
            stirred: crate::groups::Stirred::default(),
            pinged: Arc::default(),
            me: Arc::default(),
        }
    }
}

impl Liveness {
    fn dead_after(&self) -> Duration {
        *self.dead_after.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How answers are judged now, given `seen` (see [`Judge`]).
    fn judge(&self, seen: &BTreeMap<BrokerId, Heard>) -> Judge {
        let me = self.me.load(Ordering::Relaxed);
        let self_asked = (me != 0).then(|| seen.get(&me)).flatten().filter(|h| !h.refused).map(|h| h.asked);
        Judge { dead_after: self.dead_after(), self_asked }
    }

    /// Whether `broker` answered recently enough.
    pub fn is_alive(&self, broker: BrokerId) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).is_some_and(|h| judge.fresh(h))
    }

    /// Whether `broker` answered recently and is not in a controlled
    /// shutdown: a leadership may be handed to it (`crate::control::handover`).
    pub fn takes_leadership(&self, broker: BrokerId) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).is_some_and(|h| judge.fresh(h) && !h.draining)
    }

    /// The live brokers answering with a minor peer protocol version below
    /// `minor`, with theirs (a feature that older brokers cannot follow is
    /// refused while one runs).
    pub fn older_than(&self, minor: u32) -> Vec<(BrokerId, u32)> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.iter()
            .filter(|(_, h)| judge.fresh(h) && h.protocol_minor < minor)
            .map(|(b, h)| (*b, h.protocol_minor))
            .collect()
    }

    /// Whether `broker` answered recently and said it leads `group`.
    pub fn leads(&self, broker: BrokerId, group: u64) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).is_some_and(|h| judge.fresh(h) && h.leading.binary_search(&group).is_ok())
    }

    /// How many groups `broker` says it leads, as its latest ping answer
    /// says; `None` if that answer is not fresh.
    pub fn led_count(&self, broker: BrokerId) -> Option<usize> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).filter(|h| judge.fresh(h)).map(|h| h.leading.len())
    }

    /// Whether `broker` answered recently, to a ping sent at `since` or
    /// later, without saying it leads `group`: what it led before `since`
    /// it has had time to announce (see `crate::control::quiesce`).
    pub fn denies_leading(&self, broker: BrokerId, group: u64, since: Instant) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker)
            .is_some_and(|h| judge.fresh(h) && h.asked >= since && h.leading.binary_search(&group).is_err())
    }

    /// How long a ping to `broker` may take before it is given up. A broker
    /// never heard from gets [`SILENCE_MAX`]: its round trip is unknown, and
    /// an answer slower than `dead_after` must still count as heard (see
    /// [`Liveness::settled`]), or a loaded peer would never be.
    fn ping_timeout(&self, broker: BrokerId) -> Duration {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        match seen.get(&broker) {
            Some(h) => silence_allowed(judge.dead_after, h.rtt),
            None => SILENCE_MAX,
        }
    }

    /// Records that a ping to `broker` was refused: it is dead now (and,
    /// if it never answered, known to be: see [`Liveness::settled`]).
    fn refused(&self, broker: BrokerId, sent: Instant) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        let h = seen.entry(broker).or_insert_with(|| Heard {
            at: Instant::now(),
            asked: sent,
            rtt: Duration::ZERO,
            refused: true,
            leading: Vec::new(),
            boot_id: 0,
            returned_at: None,
            opening_floor: 0,
            draining: false,
            protocol_minor: 0,
        });
        if judge.fresh(h) {
            self.changed();
        }
        h.refused = true;
        // An answer to a ping sent before the refused one, arriving late,
        // does not bring the broker back (see `mark`).
        h.asked = h.asked.max(sent);
    }

    /// A number that grows whenever what the pings say about brokers
    /// changes: a broker became alive or dead, restarted, or finished
    /// opening its replicas. Not counted: which groups a broker leads
    /// ([`Liveness::take_stirred`] names the groups that changed), how far
    /// a broker has got opening its replicas ([`Liveness::has_open`]),
    /// whether pinging has [`settled`](Liveness::settled), and how long
    /// since a broker last denied leading a group: `crate::control::quiesce`
    /// looks at groups that depend on these every round or every second.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// The groups a broker began or stopped leading, as its pings say,
    /// since the last call (one consumer, `crate::control::quiesce`).
    /// A change of which groups a broker leads touches only those groups'
    /// decisions; while thousands of partitions elect, counting it as a
    /// change of everything had every group looked at every round.
    pub fn take_stirred(&self) -> std::collections::BTreeSet<u64> {
        self.stirred.take()
    }

    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether every broker has had time to answer since pinging started:
    /// one `dead_after` window has passed and every broker pinged has
    /// answered or refused the connection at least once, or, for one that
    /// did neither (slow to answer, or unreachable without a refusal),
    /// [`SILENCE_MAX`] has passed. Before that, a broker not heard from yet
    /// may be alive and leading, so nothing should be concluded from its
    /// silence: a broker that restarts into a loaded cluster, whose first
    /// pings take longer than `dead_after`, would otherwise campaign for
    /// groups led elsewhere (and, their leaders being parked, with no lease
    /// on the other followers to refuse it, win: an election for nothing).
    pub fn settled(&self) -> bool {
        let dead_after = self.dead_after();
        let Some(since) = self.started.lock().unwrap_or_else(|p| p.into_inner()).map(|t| t.elapsed()) else {
            return false;
        };
        if since < dead_after {
            return false;
        }
        if since >= SILENCE_MAX {
            return true;
        }
        let pinged = self.pinged.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        // No broker pinged yet (the image knows none, not even this one):
        // nothing was heard, so nothing is settled.
        !pinged.is_empty() && pinged.iter().all(|b| seen.contains_key(b))
    }

    /// Whether `broker` is alive and has opened the replicas its metadata
    /// assigns it (so it can campaign for them).
    pub fn is_ready(&self, broker: BrokerId) -> bool {
        self.returned_at(broker).is_some()
    }

    /// Whether `broker` is alive and has `group`'s replica open as far as
    /// its pings say: it opens no group now, or only groups from a higher
    /// id on (`PingResponse.opening_floor`). A group it hosts that failed
    /// to open counts as open: nothing here would change that.
    pub fn has_open(&self, broker: BrokerId, group: u64) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).is_some_and(|h| judge.fresh(h) && (h.opening_floor == 0 || group < h.opening_floor))
    }

    /// When `broker` came back (see the module comment), if it is alive.
    pub fn returned_at(&self, broker: BrokerId) -> Option<Instant> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        seen.get(&broker).filter(|h| judge.fresh(h)).and_then(|h| h.returned_at)
    }

    /// Records `broker`'s answer `r`, which took `rtt`.
    fn mark(&self, broker: BrokerId, r: PingResponse, rtt: Duration) {
        let PingResponse {
            leading_groups: leading,
            boot_id,
            replicas_open,
            opening_floor,
            draining,
            protocol_minor,
            ..
        } = r;
        let now = Instant::now();
        let asked = now.checked_sub(rtt).unwrap_or(now);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        let previous = seen.get(&broker);
        // Pings overlap: an answer to an older ping that arrives after a
        // newer one's (or after a refusal) says nothing newer.
        if previous.is_some_and(|h| h.asked > asked) {
            return;
        }
        let continuous = previous.is_some_and(|h| h.boot_id == boot_id && judge.fresh(h));
        let returned_at = match previous {
            _ if !replicas_open => None,
            Some(h) if continuous => h.returned_at.or(Some(now)),
            _ => Some(now),
        };
        let rtt = previous.filter(|_| continuous).map_or(rtt, |h| (h.rtt * 7 + rtt) / 8);
        // Sent sorted (GroupRegistry::leading); sorting a sorted list is one pass.
        let mut leading = leading;
        leading.sort_unstable();
        leading.dedup();
        let same = continuous && previous.is_some_and(|h| h.returned_at.is_some() == returned_at.is_some());
        if same && let Some(h) = previous.filter(|h| h.leading != leading) {
            self.stirred.stir(symmetric_difference(&h.leading, &leading));
        }
        seen.insert(
            broker,
            Heard {
                at: now,
                asked,
                rtt,
                refused: false,
                leading,
                boot_id,
                returned_at,
                opening_floor,
                draining,
                protocol_minor,
            },
        );
        if !same {
            self.changed();
        }
    }

    /// Which brokers are alive now; a change of it (a broker fell silent)
    /// counts as a change ([`Liveness::changes`]) and is logged: a broker
    /// counted dead makes its groups' followers elsewhere campaign, so an
    /// operator reading about an election storm needs to see it.
    fn note_silences(&self, alive_before: &mut Vec<BrokerId>) {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let judge = self.judge(&seen);
        let mut alive: Vec<BrokerId> = seen.iter().filter(|(_, h)| judge.fresh(h)).map(|(b, _)| *b).collect();
        alive.sort_unstable();
        if alive != *alive_before {
            // Gathered under the lock, logged after it.
            let ms = |d: Duration| d.as_millis() as u64;
            let died: Vec<(BrokerId, u64, u64, u64, bool)> = alive_before
                .iter()
                .filter(|b| !alive.contains(b))
                .filter_map(|b| {
                    let h = seen.get(b)?;
                    Some((
                        *b,
                        ms(h.at.elapsed()),
                        ms(silence_allowed(judge.dead_after, h.rtt)),
                        ms(h.rtt),
                        h.refused,
                    ))
                })
                .collect();
            drop(seen);
            for (b, silent_ms, allowed_ms, srtt_ms, refused) in died {
                tracing::warn!(
                    peer = b,
                    silent_ms,
                    allowed_ms,
                    srtt_ms,
                    refused,
                    "broker {b} counts as dead: its groups' followers here may campaign"
                );
            }
            for b in alive.iter().filter(|b| !alive_before.contains(b)) {
                tracing::info!(peer = b, "broker {b} answers pings: alive");
            }
            *alive_before = alive;
            self.changed();
        }
    }

    /// Pings every registered broker (itself included, through its own
    /// listener) every `every`, reporting one silent for `dead_after` (or
    /// longer under load, [`silence_allowed`]) or refusing the connection as
    /// dead, until the image's sender is dropped.
    pub async fn run(
        self,
        me: BrokerId,
        image: watch::Receiver<Arc<MetadataImage>>,
        peers: PeerAddresses,
        every: Duration,
        dead_after: Duration,
    ) {
        *self.dead_after.lock().unwrap_or_else(|p| p.into_inner()) = dead_after;
        *self.started.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.me.store(me, Ordering::Relaxed);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut alive = Vec::new();
        loop {
            tick.tick().await;
            if image.has_changed().is_err() {
                return;
            }
            self.note_silences(&mut alive);
            let brokers: Vec<(BrokerId, String)> =
                image.borrow().brokers.iter().map(|(id, b)| (*id, b.peer_addr.clone())).collect();
            *self.pinged.lock().unwrap_or_else(|p| p.into_inner()) =
                brokers.iter().map(|(id, _)| *id).collect();
            for (id, addr) in brokers {
                let Ok(channel) = peers.channel(&addr) else { continue };
                let this = self.clone();
                // In this loop's span (`task{name, node}`), with the peer.
                tokio::spawn(
                    async move {
                        let mut req = tonic::Request::new(PingRequest { from_broker: me });
                        req.set_timeout(this.ping_timeout(id));
                        let sent = Instant::now();
                        match crate::network::peer_client(channel).ping(req).await {
                            Ok(r) => {
                                let r = r.into_inner();
                                // A broker of another major protocol version
                                // cannot replicate with this one: not alive here.
                                if r.broker_id == id
                                    && crate::network::protocol::check_peer(
                                        id,
                                        r.protocol_major,
                                        r.protocol_minor,
                                    )
                                {
                                    this.mark(id, r, sent.elapsed());
                                }
                            }
                            // No connection (refused, reset): not merely slow.
                            Err(s) if s.code() == tonic::Code::Unavailable => this.refused(id, sent),
                            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                                tracing::error!(
                                    peer = id,
                                    "broker {id} refused this broker's ping: {}",
                                    s.message()
                                );
                            }
                            Err(_) => {}
                        }
                    }
                    .in_current_span(),
                );
            }
        }
    }
}

/// How long a broker may be silent before it counts as dead: `dead_after`,
/// or [`RTT_FACTOR`] round trips when that is longer, at most
/// [`SILENCE_MAX`] (and never less than `dead_after`).
pub fn silence_allowed(dead_after: Duration, rtt: Duration) -> Duration {
    rtt.saturating_mul(RTT_FACTOR).min(SILENCE_MAX).max(dead_after)
}

/// The elements of exactly one of the sorted, deduplicated `a` and `b`,
/// in one pass over both.
fn symmetric_difference(a: &[u64], b: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ping's answer from a broker with its replicas open.
    fn answer(leading: &[u64], boot_id: u64, opening_floor: u64) -> PingResponse {
        PingResponse {
            leading_groups: leading.to_vec(),
            boot_id,
            replicas_open: true,
            opening_floor,
            ..PingResponse::default()
        }
    }

    /// Liveness is judged on tokio's clock, which a simulation pauses and
    /// advances: a peer dies when its silence passes on that clock, with
    /// no real time passing (on `std::time::Instant` it would never die
    /// here).
    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_dies_when_the_paused_clock_passes_its_silence() {
        let l = Liveness::default();
        let dead_after = *l.dead_after.lock().unwrap();
        l.mark(2, answer(&[], 1, 0), Duration::from_millis(1));
        assert!(l.is_alive(2));
        tokio::time::advance(dead_after - Duration::from_millis(100)).await;
        assert!(l.is_alive(2), "silent for less than dead_after");
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(!l.is_alive(2), "silent for dead_after on the paused clock");
    }

    #[test]
    fn a_broker_has_open_the_groups_below_its_opening_floor() {
        let l = Liveness::default();
        assert!(!l.has_open(2, 7), "never heard from");
        l.mark(2, answer(&[], 1, 10), Duration::from_millis(1));
        assert!(l.has_open(2, 7) && l.has_open(2, 9));
        assert!(!l.has_open(2, 10) && !l.has_open(2, 11), "still opening");
        l.mark(2, answer(&[], 1, 0), Duration::from_millis(1));
        assert!(l.has_open(2, 11), "opens nothing now");
        l.refused(2, Instant::now());
        assert!(!l.has_open(2, 7), "dead");
    }

    #[test]
    fn only_an_answer_to_a_ping_sent_after_a_moment_denies_leading_since_then() {
        let l = Liveness::default();
        let before = Instant::now();
        assert!(!l.denies_leading(2, 7, before), "never heard from: says nothing");
        std::thread::sleep(Duration::from_millis(5));
        l.mark(2, answer(&[8], 1, 0), Duration::from_millis(1));
        assert!(l.denies_leading(2, 7, before), "asked after `before`, and 7 is not listed");
        assert!(!l.denies_leading(2, 8, before), "it leads 8");
        let later = Instant::now() + Duration::from_millis(1);
        assert!(!l.denies_leading(2, 7, later), "no ping sent after `later` yet");
        // An answer to an older ping, arriving late, does not replace what a
        // newer one said.
        l.mark(2, answer(&[7], 1, 0), Duration::from_millis(200));
        assert!(l.denies_leading(2, 7, before));
        assert!(!l.leads(2, 7));
        l.refused(2, Instant::now());
        assert!(!l.denies_leading(2, 7, before), "dead: denies nothing (it is not alive)");
    }

    #[test]
    fn a_broker_answering_itself_late_does_not_count_others_dead_for_it() {
        let l = Liveness::default();
        *l.dead_after.lock().unwrap() = Duration::from_millis(30);
        l.me.store(1, Ordering::Relaxed);
        l.mark(1, answer(&[], 1, 0), Duration::from_millis(1));
        l.mark(2, answer(&[], 1, 0), Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            l.is_alive(2),
            "no answer since, but this broker's own answer is as old: it may be the slow one"
        );
        l.mark(1, answer(&[], 1, 0), Duration::from_millis(1));
        assert!(!l.is_alive(2), "this broker answers itself again, and 2 stayed silent");
        l.mark(2, answer(&[], 1, 0), Duration::from_millis(1));
        assert!(l.is_alive(2));
        l.refused(2, Instant::now());
        assert!(!l.is_alive(2), "a refused connection is dead at once");
    }

    #[test]
    fn slow_answers_stretch_the_allowed_silence_within_bounds() {
        let d = Duration::from_millis(500);
        assert_eq!(silence_allowed(d, Duration::from_millis(1)), d, "an idle cluster keeps dead_after");
        assert_eq!(silence_allowed(d, Duration::from_millis(400)), Duration::from_millis(1600));
        assert_eq!(silence_allowed(d, Duration::from_secs(10)), SILENCE_MAX);
    }

    #[test]
    fn changes_count_what_the_pings_say_not_every_ping() {
        let l = Liveness::default();
        let c0 = l.changes();
        l.mark(2, answer(&[7], 1, 0), Duration::from_millis(1));
        let c1 = l.changes();
        assert!(c1 > c0, "a broker heard from for the first time");
        l.mark(2, answer(&[7], 1, 0), Duration::from_millis(1));
        assert_eq!(l.changes(), c1, "the same answer again");
        l.take_stirred();
        l.mark(2, answer(&[7, 8], 1, 0), Duration::from_millis(1));
        assert_eq!(l.changes(), c1, "leading another group changes that group only");
        assert_eq!(l.take_stirred(), [8].into());
        l.mark(2, answer(&[8, 9], 1, 0), Duration::from_millis(1));
        assert_eq!(l.take_stirred(), [7, 9].into(), "one group given up, one taken");
        let c2 = l.changes();
        l.mark(2, answer(&[7, 8], 2, 0), Duration::from_millis(1));
        let c3 = l.changes();
        assert!(c3 > c2, "it restarted");
        l.refused(2, Instant::now());
        let c4 = l.changes();
        assert!(c4 > c3, "it died");
        l.refused(2, Instant::now());
        assert_eq!(l.changes(), c4, "still dead");
        let mut alive = vec![2];
        l.note_silences(&mut alive);
        assert!(alive.is_empty() && l.changes() > c4, "the silence noted once");
        let c5 = l.changes();
        l.note_silences(&mut alive);
        assert_eq!(l.changes(), c5);
    }

    #[test]
    fn silence_is_concluded_only_once_every_broker_answered_or_refused() {
        let l = Liveness::default();
        assert!(!l.settled(), "not pinging yet");
        *l.dead_after.lock().unwrap() = Duration::from_millis(10);
        *l.started.lock().unwrap() = Some(Instant::now() - Duration::from_millis(20));
        assert!(!l.settled(), "no broker pinged yet");
        assert_eq!(l.ping_timeout(2), SILENCE_MAX, "a broker never heard from may answer slowly");
        *l.pinged.lock().unwrap() = vec![1, 2, 3];
        l.mark(1, answer(&[], 1, 0), Duration::from_millis(1));
        assert!(!l.settled(), "brokers 2 and 3 have neither answered nor refused");
        l.refused(3, Instant::now());
        assert!(!l.settled() && !l.is_alive(3), "broker 2 is still unheard");
        l.mark(2, answer(&[7], 1, 0), Duration::from_millis(1));
        assert!(l.settled());
        *l.pinged.lock().unwrap() = vec![1, 2, 3, 4];
        assert!(!l.settled(), "a broker registered since");
        *l.started.lock().unwrap() = Some(Instant::now() - SILENCE_MAX);
        assert!(l.settled(), "SILENCE_MAX is as long as an unheard broker can hold it up");
    }

    #[test]
    fn a_refused_ping_kills_at_once_and_an_answer_revives() {
        let l = Liveness::default();
        l.mark(2, answer(&[7], 1, 0), Duration::from_millis(1));
        assert!(l.is_alive(2) && l.leads(2, 7));
        l.refused(2, Instant::now());
        assert!(!l.is_alive(2) && !l.leads(2, 7));
        // The next ping, sent after the refusal.
        std::thread::sleep(Duration::from_millis(3));
        l.mark(2, answer(&[], 2, 0), Duration::from_millis(1));
        assert!(l.is_alive(2) && !l.leads(2, 7));
    }
}
