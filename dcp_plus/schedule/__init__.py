"""dcp_plus.schedule"""
