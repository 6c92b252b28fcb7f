//! `ferrolog consume TOPIC --group G`: reads as a member of a consumer
//! group ([`ferrolog_client::GroupConsumer`]), printing records as `consume`
//! does and committing the position after each batch it printed. What
//! happens to the member's partitions goes to stderr as it happens, one
//! line each:
//!
//! ```text
//! group G: member M generation N assigned t/0,t/3
//! group G: member M generation N revoked t/3
//! group G: member M generation N lost t/0: <reason>
//! group G: member M commit refused (generation N): <reason>
//! ```

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use ferrolog_client::assignor::Assignor;
use ferrolog_client::{AutoOffsetReset, GroupConsumer, GroupConsumerConfig, RebalanceEvent, Seek};

use crate::consume::{ConsumeArgs, OutputFormat};
use crate::output::record_json;

/// Prints one rebalance event of `group` on stderr, one line, naming the
/// member id it happened under.
fn report(group: &str, e: &RebalanceEvent) {
    match e {
        RebalanceEvent::Assigned { member_id: member, generation, partitions: p } => {
            eprintln!("group {group}: member {member} generation {generation} assigned {}", partitions(p));
        }
        RebalanceEvent::Revoked { member_id: member, generation, partitions: p } => {
            eprintln!("group {group}: member {member} generation {generation} revoked {}", partitions(p));
        }
        RebalanceEvent::Lost { member_id: member, generation, partitions: p, reason } => {
            eprintln!(
                "group {group}: member {member} generation {generation} lost {}: {reason}",
                partitions(p)
            );
        }
        RebalanceEvent::CommitRefused { member_id: member, generation, reason } => {
            eprintln!("group {group}: member {member} commit refused (generation {generation}): {reason}");
        }
    }
}

fn partitions(list: &[(String, u32)]) -> String {
    list.iter().map(|(t, p)| format!("{t}/{p}")).collect::<Vec<_>>().join(",")
}

/// Runs `consume --group`.
pub async fn run(bootstrap: &str, args: ConsumeArgs) -> anyhow::Result<()> {
    let group = args.group.clone().unwrap_or_default();
    let meta = crate::connect(bootstrap)?;
    meta.topic(&args.topic, crate::TOPIC_WAIT).await.with_context(|| format!("topic {:?}", args.topic))?;
    let reset = match args.from {
        Seek::Earliest => AutoOffsetReset::Earliest,
        Seek::Latest => AutoOffsetReset::Latest,
        other => bail!(
            "--from {other:?} with --group: a group starts each partition at its committed offset; --from \
             earliest or latest says where partitions without one start (group reset-offsets moves them)"
        ),
    };
    let assignors = args
        .assignor
        .iter()
        .map(|a| {
            Assignor::from_name(a).ok_or_else(|| {
                anyhow::anyhow!("unknown assignor {a:?} (range, roundrobin, cooperative-sticky)")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut config = GroupConsumerConfig::new(group.clone());
    config.group_instance_id.clone_from(&args.group_instance_id);
    config.client_id = "ferrolog-cli".into();
    config.session_timeout_ms = args.session_timeout_ms;
    config.heartbeat_interval_ms = args.heartbeat_interval_ms;
    config.assignors = assignors;
    // Committed after each printed batch instead: at least once.
    config.enable_auto_commit = false;
    config.auto_offset_reset = reset;
    let mut consumer = GroupConsumer::new(meta, config, &[args.topic.as_str()])?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let max = args.max_records.unwrap_or(u64::MAX);
    let mut printed = 0u64;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    // Each event printed as it happens (a revocation before the rejoin
    // that follows it, however long that takes), not when the poll returns.
    let listening = group.clone();
    consumer.on_rebalance(move |e| report(&listening, e));
    while printed < max {
        let polled = tokio::select! {
            r = consumer.poll(Duration::from_millis(500)) => r,
            _ = &mut ctrl_c => break,
        };
        let records = polled.with_context(|| format!("reading {} in group {group}", args.topic))?;
        if records.is_empty() {
            continue;
        }
        let mut unprinted: std::collections::BTreeMap<(String, u32), u64> = std::collections::BTreeMap::new();
        for r in &records {
            if printed >= max {
                // Not printed: it is not committed either (the partition's
                // position goes back to it).
                unprinted.entry((r.topic.clone(), r.partition)).or_insert(r.offset);
                continue;
            }
            let written = match args.output {
                OutputFormat::Value => out.write_all(&r.value).and_then(|()| out.write_all(b"\n")),
                OutputFormat::Json => writeln!(out, "{}", record_json(r)),
            };
            written.context("writing to stdout")?;
            printed += 1;
        }
        out.flush().context("writing to stdout")?;
        for ((topic, partition), offset) in unprinted {
            consumer.seek(&topic, partition, offset);
        }
        // Printed, so committed: a member that stops before this line has
        // its batch printed again by the partition's next owner.
        if let Err(e) = consumer.commit().await {
            eprintln!("warning: group {group}: commit: {e}");
        }
    }
    let member = consumer.member().member_id.clone();
    consumer.close().await.context("leaving the group")?;
    eprintln!("group {group}: member {member} closed");
    Ok(())
}
