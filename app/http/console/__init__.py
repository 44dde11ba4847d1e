"""The console's pages: server-rendered HTML (Jinja templates, htmx for the
live parts, uPlot for charts, all served from /console/static), each page a
client of the same service functions as the management API."""
