//! The run's plot (SVG): send and poll latency over time (one dot per
//! operation, coloured by outcome) above throughput per second, with each
//! fault interval shaded.

use std::path::Path;

use plotters::prelude::*;

use crate::history::{Op, OpType, Outcome};
use crate::nemesis::{Fault, FaultEvent};

fn fault_colour(f: Fault) -> RGBColor {
    match f {
        Fault::Kill => RGBColor(230, 80, 80),
        Fault::Pause => RGBColor(230, 170, 40),
        Fault::Partition => RGBColor(90, 120, 230),
        Fault::Netem => RGBColor(150, 90, 200),
        Fault::Membership => RGBColor(60, 170, 110),
        Fault::Power => RGBColor(120, 60, 160),
    }
}

fn outcome_colour(o: Outcome) -> RGBColor {
    match o {
        Outcome::Ok => RGBColor(40, 150, 60),
        Outcome::Fail => RGBColor(200, 30, 30),
        Outcome::Info => RGBColor(240, 150, 0),
    }
}

/// Draws `history` and `faults` to `path`.
///
/// # Errors
/// Drawing or file errors, as text.
pub fn draw(path: &Path, history: &[Op], faults: &[FaultEvent], title: &str) -> anyhow::Result<()> {
    draw_inner(path, history, faults, title).map_err(|e| anyhow::anyhow!("plot {}: {e}", path.display()))
}

fn draw_inner(
    path: &Path,
    history: &[Op],
    faults: &[FaultEvent],
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let secs = |ns: u64| ns as f64 / 1e9;
    let t_max = history.iter().map(|o| secs(o.complete_ns)).fold(1.0, f64::max).ceil();
    let lat = |o: &Op| ((o.complete_ns.saturating_sub(o.invoke_ns)) as f64 / 1e6).max(0.1);
    let lat_max = history.iter().map(lat).fold(10.0, f64::max) * 1.5;

    let root = SVGBackend::new(path, (1400, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let (upper, lower) = root.split_vertically(480);

    let mut chart = ChartBuilder::on(&upper)
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..t_max, (0.1f64..lat_max).log_scale())?;
    chart.configure_mesh().x_desc("time (s)").y_desc("latency (ms)").draw()?;
    for f in faults {
        chart.draw_series(std::iter::once(Rectangle::new(
            [(f.start_s, 0.1), (f.end_s, lat_max)],
            fault_colour(f.fault).mix(0.18).filled(),
        )))?;
    }
    for (op_type, size, label) in [(OpType::Poll, 1, "poll"), (OpType::Send, 2, "send")] {
        for outcome in [Outcome::Ok, Outcome::Info, Outcome::Fail] {
            let c = outcome_colour(outcome);
            let pts: Vec<(f64, f64)> = history
                .iter()
                .filter(|o| o.op_type == op_type && o.outcome == outcome && !o.final_read)
                .map(|o| (secs(o.invoke_ns), lat(o)))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let style = if op_type == OpType::Send { c.filled() } else { c.mix(0.35).filled() };
            chart
                .draw_series(pts.into_iter().map(move |p| Circle::new(p, size, style)))?
                .label(format!("{label} {outcome:?}").to_lowercase())
                .legend(move |(x, y)| Circle::new((x + 8, y), 3, c.filled()));
        }
    }
    for fault in [Fault::Kill, Fault::Pause, Fault::Partition, Fault::Netem, Fault::Membership, Fault::Power]
    {
        if faults.iter().any(|f| f.fault == fault) {
            let c = fault_colour(fault);
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())?
                .label(fault.name())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], c.mix(0.4).filled()));
        }
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;

    // Throughput: ok sends and values read per second.
    let buckets = t_max as usize + 1;
    let mut sends = vec![0u32; buckets];
    let mut reads = vec![0u32; buckets];
    let mut unsure = vec![0u32; buckets];
    for o in history.iter().filter(|o| !o.final_read) {
        let b = (secs(o.complete_ns) as usize).min(buckets - 1);
        match (o.op_type, o.outcome) {
            (OpType::Send, Outcome::Ok) => sends[b] += o.msgs.len() as u32,
            (OpType::Send, _) => unsure[b] += o.msgs.len() as u32,
            (OpType::Poll, Outcome::Ok) => reads[b] += o.msgs.len() as u32,
            _ => {}
        }
    }
    let y_max = sends.iter().chain(&reads).copied().max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(&lower)
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)?;
    chart.configure_mesh().x_desc("time (s)").y_desc("values / s").draw()?;
    for f in faults {
        chart.draw_series(std::iter::once(Rectangle::new(
            [(f.start_s, 0.0), (f.end_s, y_max)],
            fault_colour(f.fault).mix(0.18).filled(),
        )))?;
    }
    for (series, colour, label) in [
        (&sends, RGBColor(40, 150, 60), "values acknowledged"),
        (&unsure, RGBColor(240, 150, 0), "values sent, not acknowledged"),
        (&reads, RGBColor(60, 90, 200), "values read (all consumers)"),
    ] {
        chart
            .draw_series(LineSeries::new(
                series.iter().enumerate().map(|(i, v)| (i as f64 + 0.5, f64::from(*v))),
                colour,
            ))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
