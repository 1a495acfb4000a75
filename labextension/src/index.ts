/**
 * jupyter-llama's JupyterLab front end: a "Llama" side panel, a status-bar item,
 * palette commands (open, load, unload, pull, refresh) and a refresh-interval setting.
 * It talks only to the REST API under ``<base_url>llama/``.
 */
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, InputDialog, Notification } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

import { LlamaApi } from './api';
import { llamaIcon } from './icon';
import { modelRows, peopleOf } from './model';
import { LlamaPanel } from './panel';
import { LlamaState } from './state';
import { LlamaStatusItem } from './statusbar';

const PLUGIN_ID = 'jupyter-llama:plugin';

export namespace CommandIDs {
  export const open = 'jupyter-llama:open';
  export const load = 'jupyter-llama:load';
  export const unload = 'jupyter-llama:unload';
  export const pull = 'jupyter-llama:pull';
  export const refresh = 'jupyter-llama:refresh';
}

const CATEGORY = 'Llama';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Models, memory and scheduler decisions of jupyter-llama.',
  autoStart: true,
  optional: [ICommandPalette, ISettingRegistry, IStatusBar, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null
  ) => {
    const api = new LlamaApi(app.serviceManager.serverSettings);
    const state = new LlamaState(api);
    const panel = new LlamaPanel(state);
    app.shell.add(panel, 'left', { rank: 900 });
    if (restorer) {
      restorer.add(panel, panel.id);
    }

    const openPanel = () => {
      app.shell.activateById(panel.id);
    };

    let showStatus = true;
    let statusItem: LlamaStatusItem | null = null;
    if (statusBar) {
      statusItem = new LlamaStatusItem(state, openPanel);
      statusBar.registerStatusItem(PLUGIN_ID, {
        item: statusItem,
        align: 'left',
        rank: 900,
        isActive: () => showStatus
      });
    }

    const { commands } = app;
    commands.addCommand(CommandIDs.open, {
      label: 'Open the Llama Panel',
      caption: 'Show registered and loaded models, memory per device and scheduler decisions',
      icon: llamaIcon,
      execute: openPanel
    });
    commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh the Llama Panel',
      execute: () => state.refresh()
    });
    commands.addCommand(CommandIDs.load, {
      label: args => (args['model'] ? `Load ${args['model']}` : 'Load a Model…'),
      caption: 'Load a registered model (with the default options)',
      execute: async args => {
        let name = args['model'] as string | undefined;
        if (!name) {
          const tags = state.tags ?? (await api.tags().catch(() => null));
          const choices = modelRows(tags, state.ps).filter(m => !m.loaded).map(m => m.name);
          if (!choices.length) {
            Notification.info('No registered model is left to load.', { autoClose: 4000 });
            return;
          }
          const res = await InputDialog.getItem({ title: 'Load a model', items: choices });
          if (!res.button.accept || !res.value) {
            return;
          }
          name = res.value;
        }
        await state.load(name);
      }
    });
    commands.addCommand(CommandIDs.unload, {
      label: args => (args['model'] ? `Unload ${args['model']}` : 'Unload a Model…'),
      caption: 'Unload a loaded model (keep_alive 0)',
      execute: async args => {
        let name = args['model'] as string | undefined;
        if (!name) {
          const models = (state.ps?.models ?? []).filter(m => m.name || m.model);
          if (!models.length) {
            Notification.info('No model is loaded.', { autoClose: 4000 });
            return;
          }
          // on a shared manager, only what the manager lets this user unload
          const loaded = models.filter(m => peopleOf(m, state.me)?.mayUnload !== false).map(m => m.name || m.model || '');
          if (!loaded.length) {
            Notification.info('No loaded model is yours to unload: other users loaded them or are using them.', {
              autoClose: 4000
            });
            return;
          }
          const res = await InputDialog.getItem({ title: 'Unload a model', items: loaded });
          if (!res.button.accept || !res.value) {
            return;
          }
          name = res.value;
        }
        await state.unload(name);
      }
    });
    commands.addCommand(CommandIDs.pull, {
      label: 'Pull a Model…',
      caption: 'Download a GGUF model into the registry (a registry name such as llama3.2:1b, hf.co/owner/repo:quant or a URL)',
      execute: async args => {
        let source = args['source'] as string | undefined;
        if (!source) {
          const res = await InputDialog.getText({
            title: 'Pull a model',
            placeholder: 'llama3.2:1b, hf.co/owner/repo:quant or a URL'
          });
          if (!res.button.accept || !res.value?.trim()) {
            return;
          }
          source = res.value.trim();
        }
        openPanel();
        await state.pullModel(source, args['destination'] as string | undefined);
      }
    });

    if (palette) {
      for (const command of [
        CommandIDs.open,
        CommandIDs.load,
        CommandIDs.unload,
        CommandIDs.pull,
        CommandIDs.refresh
      ]) {
        palette.addItem({ command, category: CATEGORY });
      }
    }

    if (settingRegistry) {
      const apply = (settings: ISettingRegistry.ISettings) => {
        state.setInterval(settings.get('refreshInterval').composite as number);
        showStatus = settings.get('showStatusItem').composite as boolean;
        statusItem?.setHidden(!showStatus);
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason => {
          console.error('jupyter-llama: cannot read the settings', reason);
        });
    }
  }
};

export default plugin;
