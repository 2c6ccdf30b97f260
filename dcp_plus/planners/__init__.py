"""dcp_plus.planners"""
