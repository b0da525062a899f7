"""The verbs: one module per `draftport <verb>`, holding its config, its run function and its rendering.

The library parts below (check/, model/, data/, decode/, capture/, train/, study/) hold no argparse, no
rich tables and no layout of a verb's output folder; `draftport.cli` maps each verb to its module here.
"""
