//! Minimal SVG charts for benchmark results (grouped bars), so benchmarks need no plotting
//! tool: every `strata-bench` writes a table (CSV and JSON) and a chart next to it.

pub struct Series {
    pub name: String,
    pub values: Vec<f64>,
}

const COLORS: [&str; 6] = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A grouped bar chart: one group per category, one bar per series.
pub fn bars(title: &str, y_label: &str, categories: &[String], series: &[Series]) -> String {
    let (w, h, left, bottom, top) = (960.0, 420.0, 70.0, 90.0, 40.0);
    let plot_w = w - left - 20.0;
    let plot_h = h - top - bottom;
    let max =
        series.iter().flat_map(|s| s.values.iter().copied()).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let group_w = plot_w / categories.len().max(1) as f64;
    let bar_w = (group_w * 0.8) / series.len().max(1) as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
        w / 2.0,
        esc(title)
    );
    for i in 0..=5 {
        let v = max * i as f64 / 5.0;
        let y = top + plot_h - plot_h * i as f64 / 5.0;
        s += &format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            w - 20.0,
            left - 5.0,
            y + 4.0,
            fmt(v)
        );
    }
    s += &format!(
        "<text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">{}</text>\n",
        top + plot_h / 2.0,
        top + plot_h / 2.0,
        esc(y_label)
    );
    for (ci, cat) in categories.iter().enumerate() {
        let gx = left + group_w * ci as f64 + group_w * 0.1;
        for (si, ser) in series.iter().enumerate() {
            let v = ser.values.get(ci).copied().unwrap_or(0.0);
            let bh = plot_h * v / max;
            let x = gx + bar_w * si as f64;
            s += &format!(
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"{}\"><title>{}: {}</title></rect>\n",
                top + plot_h - bh,
                bar_w * 0.95,
                COLORS[si % COLORS.len()],
                esc(&ser.name),
                fmt(v)
            );
        }
        s += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" transform=\"rotate(-30 {:.1} {:.1})\">{}</text>\n",
            gx + group_w * 0.4,
            top + plot_h + 14.0,
            gx + group_w * 0.4,
            top + plot_h + 14.0,
            esc(cat)
        );
    }
    for (si, ser) in series.iter().enumerate() {
        let x = left + 10.0 + 170.0 * si as f64;
        s += &format!(
            "<rect x=\"{x}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
            h - 18.0,
            COLORS[si % COLORS.len()],
            x + 14.0,
            h - 9.0,
            esc(&ser.name)
        );
    }
    s + "</svg>\n"
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Stack several charts into one SVG.
pub(crate) fn stack(charts: Vec<String>) -> String {
    let h = 420;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"960\" height=\"{}\">\n",
        h * charts.len()
    );
    for (i, c) in charts.into_iter().enumerate() {
        s += &c.replacen("<svg ", &format!("<svg y=\"{}\" ", i * h), 1);
    }
    s + "</svg>\n"
}
