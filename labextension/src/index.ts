/**
 * gpulease in JupyterLab: the "GPU Leases" panel (board and booking calendar; launcher, command
 * palette) and a status bar item.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { GpuLeaseModel } from './model';
import { GpuLeasePanel, Tab } from './panel';
import { GpuLeaseStatus } from './status';

const OPEN = 'gpulease:open';
const CALENDAR = 'gpulease:calendar';
const NEW_BOOKING = 'gpulease:new-booking';

export const gpuIcon = new LabIcon({
  name: 'gpulease:gpu',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<path d="M7 7h10v10H7z" fill-opacity=".35"/>' +
    '<path d="M5 5h14v14H5zm2 2v10h10V7z"/>' +
    '<path d="M8 2h2v3H8zm6 0h2v3h-2zM8 19h2v3H8zm6 0h2v3h-2zM2 8h3v2H2zm0 6h3v2H2zm17-6h3v2h-3zm0 6h3v2h-3z"/>' +
    '</g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'gpulease:plugin',
  description:
    'A live GPU board, a booking calendar, your GPU leases and bookings, and a status bar item.',
  autoStart: true,
  optional: [ICommandPalette, ILauncher, IStatusBar, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    launcher: ILauncher | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null
  ) => {
    const model = new GpuLeaseModel();
    const tracker = new WidgetTracker<MainAreaWidget<GpuLeasePanel>>({ namespace: 'gpulease' });
    let widget: MainAreaWidget<GpuLeasePanel> | null = null;

    /** The panel, made (and put in the main area) if need be, and shown. */
    const open = (): MainAreaWidget<GpuLeasePanel> => {
      if (!widget || widget.isDisposed) {
        widget = new MainAreaWidget({ content: new GpuLeasePanel(model) });
        widget.id = 'gpulease-panel';
        widget.title.label = 'GPU Leases';
        widget.title.icon = gpuIcon;
        widget.title.closable = true;
        widget.toolbar.hide(); // nothing to put there: the board updates itself
        void tracker.add(widget);
      }
      if (!widget.isAttached) {
        app.shell.add(widget, 'main');
      }
      app.shell.activateById(widget.id);
      return widget;
    };
    const openOn = (tab: Tab, newBooking: boolean) => {
      const shown = open();
      shown.content.showView(tab, newBooking);
      return shown;
    };

    app.commands.addCommand(OPEN, {
      label: 'GPU Leases',
      caption: 'The GPU board, the booking calendar, your GPU leases and bookings',
      icon: gpuIcon,
      execute: open
    });
    app.commands.addCommand(CALENDAR, {
      label: 'GPU Leases: Calendar',
      caption: "The booking calendar: everyone's bookings of a pool, from today on",
      icon: gpuIcon,
      execute: () => openOn('calendar', false)
    });
    app.commands.addCommand(NEW_BOOKING, {
      label: 'GPU Leases: New booking…',
      caption: 'Book GPUs of a pool for a time window (the booking form)',
      icon: gpuIcon,
      execute: () => openOn('calendar', true)
    });
    // "GPU Leases" first: it is what typing the name is most likely after.
    palette?.addItem({ command: OPEN, category: 'GPU Leases', rank: 0 });
    palette?.addItem({ command: CALENDAR, category: 'GPU Leases', rank: 1 });
    palette?.addItem({ command: NEW_BOOKING, category: 'GPU Leases', rank: 2 });
    launcher?.add({ command: OPEN, category: 'Other', rank: 0 });
    if (restorer) {
      void restorer.restore(tracker, { command: OPEN, name: () => 'gpulease' });
    }
    if (statusBar) {
      statusBar.registerStatusItem('gpulease:status', {
        item: new GpuLeaseStatus(model, () => void app.commands.execute(OPEN)),
        align: 'left',
        rank: 50
      });
    }
    void app.restored.then(() => model.start());
  }
};

export default plugin;
