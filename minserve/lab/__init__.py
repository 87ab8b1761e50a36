"""Notebook helpers: the course plotly theme, figures and tables from minserve results, widget builders."""
