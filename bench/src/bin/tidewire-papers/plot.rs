use plotters::prelude::*;

pub(crate) fn colors() -> [RGBColor; 4] {
    [
        RGBColor(200, 60, 40),
        RGBColor(40, 110, 200),
        RGBColor(30, 150, 70),
        RGBColor(140, 80, 170),
    ]
}

pub(crate) type Series = (String, Vec<(f64, f64)>);

/// One panel: lines with markers; `dots` are extra points drawn unjoined.
/// The axes start at 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    xdesc: &str,
    ydesc: &str,
    lines: &[Series],
    dots: &[Series],
    ideal: Option<Vec<(f64, f64)>>,
) -> Result<(), String> {
    panel_in(area, title, (xdesc, ydesc), lines, dots, ideal, true)
}

/// [`panel`], with axes that span only the data unless `from_zero`.
pub(crate) fn panel_in(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    (xdesc, ydesc): (&str, &str),
    lines: &[Series],
    dots: &[Series],
    ideal: Option<Vec<(f64, f64)>>,
    from_zero: bool,
) -> Result<(), String> {
    let (xr, yr) = axis_ranges(lines, dots, ideal.as_deref(), from_zero);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(xr, yr)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(xdesc)
        .y_desc(ydesc)
        .draw()
        .map_err(|e| e.to_string())?;
    if let Some(i) = ideal {
        chart
            .draw_series(LineSeries::new(i, BLACK.mix(0.35).stroke_width(1)))
            .map_err(|e| e.to_string())?
            .label("linear")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.35)));
    }
    for (k, (label, pts)) in lines.iter().enumerate() {
        let c = colors()[k % 4];
        // A time series is drawn thin: thick lines' joins spike at its steps.
        let w = if pts.len() <= 60 { 2 } else { 1 };
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(w)))
            .map_err(|e| e.to_string())?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        // Markers on figures' points, not on a time series.
        if pts.len() <= 60 {
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    for (k, (label, pts)) in dots.iter().enumerate() {
        let c = colors()[k % 4];
        chart
            .draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 6, c.stroke_width(2))))
            .map_err(|e| e.to_string())?
            .label(label.clone())
            .legend(move |(x, y)| TriangleMarker::new((x + 9, y), 6, c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The axes' spans over every point: from 0 with `from_zero` (or without
/// points), else the data's with a margin.
fn axis_ranges(
    lines: &[Series],
    dots: &[Series],
    ideal: Option<&[(f64, f64)]>,
    from_zero: bool,
) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let all = lines.iter().chain(dots).flat_map(|s| s.1.iter());
    let (mut x0, mut y0) = (f64::INFINITY, f64::INFINITY);
    let (mut x1, mut y1) = (0f64, 0f64);
    for &(x, y) in all.chain(ideal.iter().copied().flatten()) {
        x0 = x0.min(x);
        y0 = y0.min(y);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if from_zero || !x0.is_finite() {
        (0f64..x1 * 1.05, 0f64..(y1 * 1.15).max(1e-9))
    } else {
        let (dx, dy) = ((x1 - x0).max(1e-9) * 0.05, (y1 - y0).max(y1.abs() * 0.01).max(1e-9));
        (x0 - dx..x1 + dx, y0 - dy * 0.5..y1 + dy * 0.8)
    }
}
