"""Templates and static files of the dashboard (routes: api/dashboard.py).

static/uPlot.* is uPlot 1.6.32 (MIT, static/uPlot.LICENSE), copied unchanged from the npm package
`uplot` (dist/uPlot.iife.min.js, dist/uPlot.min.css): a 51 KB canvas charting library, served from
here so that the dashboard needs no CDN and no build step.
"""
