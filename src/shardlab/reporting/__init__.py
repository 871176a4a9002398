"""Rendering the report and the chart helpers its sections use (no training code here)."""
