"""Tuning reports."""

from torch_tweak.torch.report.report import CandidateReport, GraphReport, ModuleReport, TuningReport

__all__ = ["CandidateReport", "GraphReport", "ModuleReport", "TuningReport"]
